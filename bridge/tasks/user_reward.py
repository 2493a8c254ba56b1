"""Reward overrides for any task: bring your own reward function (verl's convention), or a
built-in one such as math-verify. `registry.make_task` applies them, so an override runs
wherever that task's rewards are computed.

    make_task("gsm8k", path=..., reward_fn="/abs/my_reward.py:compute_score")  # task.reward_fn
    make_task("arithmetic", reward="math_verify")

Task options read here (and not passed to the task itself):
- `reward_fn="PATH.py:NAME"`: `NAME(data_source, solution_str, ground_truth, extra_info=None)`
  returning a float, or a dict with "score" whose other numeric entries become metrics
  (`score_detailed`). data_source is the task name, solution_str the completion decoded
  without special tokens, ground_truth the task's reference answer (`Prompt.answer`),
  extra_info `{"prompt_id", "prompt"}`. The path is made absolute when the task is built.
- `reward_fn_style="trl"`: NAME is a TRL batched function instead,
  `NAME(prompts, completions, **kwargs) -> list[float]`, called with one-element lists and
  the columns `ground_truth`, `solution` (both the reference answer), `data_source`, `prompt_id`.
- `reward="math_verify"`: `math_reward.compute_score` (an error if combined with reward_fn).
- `reward_timeout_s` (default 5): the override runs in `reward_pool.default_pool()` under
  this timeout, so a hanging function is killed, not waited on; 0 runs it inline.

A bad path, a module that fails to import or a missing NAME fails in `make_task`. At scoring
time a function that raises, times out or returns a non-number gives a `RewardError` naming
it (PATH:NAME); each is counted in `RewardOverride.stats()` (the pool keeps its own counts
too). Nothing a reward function does crashes the caller's process.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import threading
from collections.abc import Callable
from typing import Any

from bridge.tasks import reward_pool
from bridge.tasks.base import Prompt, RewardError, Task

OPTION_KEYS = ("reward", "reward_fn", "reward_fn_style", "reward_timeout_s")
BUILTIN = {"math_verify": "bridge.tasks.math_reward:compute_score"}
STYLES = ("verl", "trl")


def _load_file(path: str):
    module_name = "echo2_reward_fn_" + "".join(c if c.isalnum() else "_" for c in path)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot load {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def resolve(spec: str) -> Callable:
    """The function named by "PATH.py:NAME" (a file) or "package.module:NAME" (built-ins)."""
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"reward_fn must look like 'PATH.py:NAME', got {spec!r}")
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise FileNotFoundError(f"reward_fn {spec!r}: no such file {where!r}")
        try:
            module = _load_file(where)
        except Exception as e:
            raise ValueError(f"reward_fn {spec!r}: importing {where} failed: {e!r}") from e
    else:
        module = importlib.import_module(where)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"reward_fn {spec!r}: {where} defines no function {name!r}")
    return fn


def call_reward_fn(
    spec: str, style: str, data_source: str, prompt_id: str, prompt: str, answer: str, text: str
) -> Any:
    """Call the function `spec` names in `style` (top-level, so a pool worker can run it)."""
    fn = resolve(spec)
    if style == "trl":
        out = fn(
            prompts=[prompt],
            completions=[text],
            ground_truth=[answer],
            solution=[answer],
            data_source=[data_source],
            prompt_id=[prompt_id],
        )
        if not isinstance(out, list | tuple) or len(out) != 1:
            raise TypeError(f"a TRL reward function must return a 1-element list, got {out!r}")
        return out[0]
    extra_info = {"prompt_id": prompt_id, "prompt": prompt}
    return fn(
        data_source=data_source, solution_str=text, ground_truth=answer, extra_info=extra_info
    )


def _check(label: str, value: Any) -> float | dict[str, Any]:
    score = value.get("score") if isinstance(value, dict) else value
    if isinstance(value, dict) and "score" not in value:
        raise RewardError(f"{label} returned a dict without 'score': keys {sorted(value)}")
    if isinstance(score, bool) or not isinstance(score, int | float):
        raise RewardError(f"{label} returned {type(score).__name__} {score!r}, not a number")
    if not math.isfinite(score):
        raise RewardError(f"{label} returned {score}, not a finite number")
    return value


class RewardOverride:
    """A task's replacement reward; `install` puts it in place of the task's own."""

    def __init__(self, spec: str, style: str = "verl", timeout_s: float | None = None):
        if style not in STYLES:
            raise ValueError(f"reward_fn_style must be one of {STYLES}, got {style!r}")
        resolve(spec)  # fail now, at make_task time, on a bad path or name
        self.spec, self.style = spec, style
        self.timeout_s = reward_pool.DEFAULT_TIMEOUT_S if timeout_s is None else float(timeout_s)
        self.label = f"reward_fn {spec}"
        self._lock = threading.Lock()
        self._stats = {"reward/calls": 0, "reward/errors": 0, "reward/timeouts": 0}

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)

    def _count(self, key: str) -> None:
        with self._lock:
            self._stats[key] += 1

    def __call__(self, task_name: str, prompt: Prompt, completion: str) -> float | dict[str, Any]:
        self._count("reward/calls")
        args = (self.spec, self.style, task_name, prompt.prompt_id, prompt.text, prompt.answer)
        try:
            value = reward_pool.guarded_call(
                call_reward_fn, *args, completion, timeout_s=self.timeout_s
            )
        except reward_pool.RewardTimeout as e:
            self._count("reward/timeouts")
            raise reward_pool.RewardTimeout(
                f"{self.label} timed out (limit {self.timeout_s:g} s)"
            ) from e
        except RewardError as e:
            self._count("reward/errors")
            # The pool names its top-level shim; say which user function it was instead.
            shim = reward_pool.fn_name(call_reward_fn) + " raised "
            raise RewardError(f"{self.label} " + str(e).replace(shim, "raised ")) from e
        except Exception as e:  # noqa: BLE001 - inline calls: a user's function may raise anything
            self._count("reward/errors")
            raise RewardError(f"{self.label} raised {type(e).__name__}: {e}") from e
        try:
            return _check(self.label, value)
        except RewardError:
            self._count("reward/errors")
            raise

    def install(self, task: Task) -> None:
        name = task.name

        def reward_detailed(prompt: Prompt, completion: str) -> float | dict[str, Any]:
            return self(name, prompt, completion)

        def reward(prompt: Prompt, completion: str) -> float:
            value = self(name, prompt, completion)
            return value["score"] if isinstance(value, dict) else value

        # Instance attributes shadow the class's methods, so every caller gets the override.
        task.reward, task.reward_detailed = reward, reward_detailed
        task.reward_override = self


def from_options(options: dict[str, Any]) -> tuple[RewardOverride | None, dict[str, Any]]:
    """Split a task's options into (override or None, options for the task itself); the
    options returned for the record have the reward_fn path made absolute."""
    builtin, spec = options.get("reward") or "", options.get("reward_fn") or ""
    if builtin and builtin != "task":
        if spec:
            raise ValueError("give either reward= or reward_fn=, not both")
        if builtin not in BUILTIN:
            raise ValueError(f"unknown reward {builtin!r}; built-in: {sorted(BUILTIN)}")
        spec = BUILTIN[builtin]
    elif spec:
        where, sep, name = spec.rpartition(":")
        if sep and where.endswith(".py"):
            spec = f"{os.path.abspath(where)}:{name}"
            options = {**options, "reward_fn": spec}
    if not spec:
        return None, options
    timeout = options.get("reward_timeout_s")
    style = options.get("reward_fn_style") or "verl"
    override = RewardOverride(spec, style, None if timeout in (None, "") else float(timeout))
    return override, options
