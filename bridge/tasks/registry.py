"""The task registry: tasks register by decorator and are built by name with options.

    task = make_task("arithmetic", digits=2, ops="+-")   # on a worker: cached_task(name, options)

Each task module (a plugin) imports this registry, never the reverse; `bridge/tasks/__init__.py`
imports the built-in plugins so they are registered whenever the package is imported.
Any task's reward can be replaced by options (`reward_fn="PATH.py:NAME"`,
`reward="math_verify"`; see `user_reward.py`).
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Callable
from typing import Any

from bridge.tasks import user_reward
from bridge.tasks.base import Prompt, Task, score_detailed

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
    """The task `name` built with `options`; the reward options of `user_reward` (reward_fn,
    reward="math_verify", ...) are taken out here and replace the task's own reward.
    `module="my_pkg.my_env"` imports that module first, so a task or environment it
    registers can be named (a user's own, outside bridge.tasks)."""
    module = options.pop("module", "") or ""
    if module:
        importlib.import_module(module)
    if name not in _TASKS:
        raise KeyError(f"unknown task {name!r}; registered: {sorted(_TASKS)}")
    override, options = user_reward.from_options(options)
    own = {k: v for k, v in options.items() if k not in user_reward.OPTION_KEYS}
    task = _TASKS[name](**own)
    # Kept so the controller can ship (name, options) in each lease and a worker rebuilds
    # the same reward function with `cached_task`.
    task.options = dict(options, **({"module": module} if module else {}))
    if override is not None:
        override.install(task)
    return task


@functools.lru_cache(maxsize=32)
def _cached(name: str, options_json: str) -> Task:
    return make_task(name, **json.loads(options_json))


def cached_task(name: str, options: dict[str, Any] | None = None) -> Task:
    """One task object per (name, options), for workers scoring many leases."""
    return _cached(name, json.dumps(options or {}, sort_keys=True))


def score_named(
    name: str, options: dict[str, Any] | None, prompt: Prompt, completion: str
) -> tuple[float, dict[str, float]]:
    """`score_detailed` with the task (name, options); a top-level function, so a reward pool
    worker can run it: `pool.call(score_named, name, options, prompt, completion)` scores one
    completion under a timeout (the trusted side's way to score everything)."""
    return score_detailed(cached_task(name, options), prompt, completion)
