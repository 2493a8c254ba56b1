"""The task registry: tasks register by decorator and are built by name with options.

    task = make_task("arithmetic", digits=2, ops="+-")   # on a worker: cached_task(name, options)

Each task module (a plugin) imports this registry, never the reverse; `bridge/tasks/__init__.py`
imports the built-in plugins so they are registered whenever the package is imported.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from bridge.tasks.base import Task

_TASKS: dict[str, Callable[..., Task]] = {}


def register_task(name: str):
    def deco(factory):
        if name in _TASKS:
            raise ValueError(f"task {name!r} registered twice")
        _TASKS[name] = factory
        if isinstance(factory, type):
            factory.name = name
        return factory

    return deco


def available_tasks() -> list[str]:
    return sorted(_TASKS)


def make_task(name: str, **options: Any) -> Task:
    if name not in _TASKS:
        raise KeyError(f"unknown task {name!r}; registered: {sorted(_TASKS)}")
    task = _TASKS[name](**options)
    # Kept so the controller can ship (name, options) in each lease and a worker rebuilds
    # the same reward function with `cached_task`.
    task.options = dict(options)
    return task


@functools.lru_cache(maxsize=32)
def _cached(name: str, options_json: str) -> Task:
    return make_task(name, **json.loads(options_json))


def cached_task(name: str, options: dict[str, Any] | None = None) -> Task:
    """One task object per (name, options), for workers scoring many leases."""
    return _cached(name, json.dumps(options or {}, sort_keys=True))
