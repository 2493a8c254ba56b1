"""Task adapters (the data plane): prompts, a reward function, optional SFT examples.

A task is registered by decorator and built by name with keyword options:

    task = make_task("arithmetic", digits=2, ops="+-")   # on a worker: cached_task(name, options)
    for p in itertools.islice(task.train_prompts(seed=0), 4): ...
    r = score(task, p, "46")        # float; RewardError (never a crash) on a bad reward fn

Contract of a task:
- `train_prompts(seed)` an endless, deterministic iterator of `Prompt`s (same seed, same
  stream), so a restarted controller can skip what it already drew.
- `eval_prompts()` a fixed held-out list, disjoint from the training stream.
- `reward(prompt, completion)` a float for one completion text (special tokens removed).
- `sft_examples(seed)` an iterator of (prompt text, target completion text), or nothing.

Built in: `arithmetic` (below, synthetic and the demo's default) and `gsm8k`
(bridge/tasks_gsm8k.py, a local JSONL file, no downloads). Prompts stay short printable
ASCII because the tiny demo model's tokenizer is character-level.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import json
import math
import random
import re
from collections.abc import Callable, Iterator
from typing import Any

_TASKS: dict[str, Callable[..., Task]] = {}


class RewardError(ValueError):
    """A task's reward function raised or returned something that is not a finite number."""


@dataclasses.dataclass(frozen=True)
class Prompt:
    prompt_id: str
    text: str
    answer: str


class Task(abc.ABC):
    """Base class; subclasses set `name` and implement the prompt/reward methods (a subclass
    missing one fails when it is built, not mid-run)."""

    name: str = ""
    options: dict[str, Any] = {}  # set per instance by make_task

    @abc.abstractmethod
    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        """Endless, deterministic stream of training prompts for `seed`."""

    @abc.abstractmethod
    def eval_prompts(self) -> list[Prompt]:
        """The fixed held-out prompts, disjoint from the training stream."""

    @abc.abstractmethod
    def reward(self, prompt: Prompt, completion: str) -> float:
        """Reward of one completion text (special tokens removed)."""

    def sft_examples(self, seed: int) -> Iterator[tuple[str, str]]:
        return iter(())


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
    _load_builtins()
    return sorted(_TASKS)


def make_task(name: str, **options: Any) -> Task:
    _load_builtins()
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


def _load_builtins() -> None:
    # Registration happens on import; tasks in other modules register themselves here.
    from bridge import tasks_gsm8k  # noqa: F401


def score(task: Task, prompt: Prompt, completion: str) -> float:
    """The task's reward as a finite float; any failure becomes a RewardError naming the task."""
    try:
        value = task.reward(prompt, completion)
    except Exception as e:  # noqa: BLE001 - a user's reward fn may raise anything
        raise RewardError(
            f"task {task.name!r}: reward function raised {type(e).__name__}: {e} "
            f"(prompt_id={prompt.prompt_id!r})"
        ) from e
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise RewardError(
            f"task {task.name!r}: reward function returned {type(value).__name__} "
            f"{value!r}, not a number (prompt_id={prompt.prompt_id!r})"
        )
    if not math.isfinite(value):
        raise RewardError(f"task {task.name!r}: reward {value} is not finite")
    return float(value)


_LEADING_INT = re.compile(r"\s*(-?\d+)")


def leading_int(text: str) -> int | None:
    m = _LEADING_INT.match(text)
    return int(m.group(1)) if m else None


@register_task("arithmetic")
class Arithmetic(Task):
    """Seeded `a<op>b=` problems; the answer is the exact integer result.

    Knobs: `digits` (max digits per operand), `min_digits`, `ops` (subset of "+-*"),
    `allow_negative` (else a-b has a >= b), `eval_size`, `eval_every` (one problem in
    `eval_every` is held out, by a fixed hash of the problem, never trained on).
    Reward: 1.0 when the completion's leading integer equals the answer; otherwise
    `format_reward` (default 0.0) if it at least starts with an integer, else 0.0.
    With `strict=True` the whole stripped completion must equal the answer.

    `sft_label_noise` models a sloppy teacher for the SFT warm start: that fraction of the
    SFT targets overshoots by one (answer + 1). Above 0.5 the overshoot is the teacher's
    most common answer, so an imitating policy answers one too high while still computing
    the right result internally (it must, to overshoot it); RL against the exact reward has
    to unlearn the habit. It touches only `sft_examples`: prompts, rewards and the held-out
    set stay exact.
    """

    def __init__(
        self,
        digits: int = 2,
        min_digits: int = 1,
        ops: str = "+-",
        allow_negative: bool = False,
        eval_size: int = 200,
        eval_every: int = 10,
        format_reward: float = 0.0,
        strict: bool = False,
        sft_label_noise: float = 0.0,
    ):
        if not 1 <= min_digits <= digits <= 9:
            raise ValueError(f"need 1 <= min_digits <= digits <= 9, got {min_digits}, {digits}")
        if not ops or set(ops) - set("+-*"):
            raise ValueError(f"ops must be a non-empty subset of '+-*', got {ops!r}")
        if eval_every < 2:
            raise ValueError("eval_every must be >= 2 so some problems remain for training")
        self.digits, self.min_digits, self.ops = digits, min_digits, ops
        self.allow_negative, self.eval_size, self.eval_every = allow_negative, eval_size, eval_every
        self.format_reward, self.strict = float(format_reward), strict
        if not 0.0 <= sft_label_noise <= 1.0:
            raise ValueError(f"sft_label_noise must be in [0, 1], got {sft_label_noise}")
        self.sft_label_noise = float(sft_label_noise)

    def _problem(self, rng: random.Random) -> tuple[int, str, int]:
        lo = 0 if self.min_digits == 1 else 10 ** (self.min_digits - 1)
        a, b = rng.randint(lo, 10**self.digits - 1), rng.randint(lo, 10**self.digits - 1)
        op = rng.choice(self.ops)
        if op == "-" and not self.allow_negative and a < b:
            a, b = b, a
        return a, op, b

    def _held_out(self, a: int, op: str, b: int) -> bool:
        # A fixed arithmetic hash (not Python's salted hash()) so the split is stable.
        return (a * 1_000_003 + b * 7_919 + ord(op) * 104_729) % self.eval_every == 0

    @staticmethod
    def _prompt(split: str, i: int, a: int, op: str, b: int) -> Prompt:
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Prompt(f"arithmetic/{split}/{i}", f"{a}{op}{b}=", str(value))

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        rng, i = random.Random(seed), 0
        while True:
            a, op, b = self._problem(rng)
            if not self._held_out(a, op, b):
                yield self._prompt("train", i, a, op, b)
                i += 1

    def eval_prompts(self) -> list[Prompt]:
        rng, out, seen, tries = random.Random(-1), [], set(), 0
        # Small digit counts have few held-out problems; stop once the space is exhausted.
        while len(out) < self.eval_size and tries < 200 * self.eval_size:
            tries += 1
            a, op, b = self._problem(rng)
            if self._held_out(a, op, b) and (a, op, b) not in seen:
                seen.add((a, op, b))
                out.append(self._prompt("eval", len(out), a, op, b))
        return out

    def reward(self, prompt: Prompt, completion: str) -> float:
        if self.strict:
            return 1.0 if completion.strip() == prompt.answer else 0.0
        got = leading_int(completion)
        if got is None:
            return 0.0
        return 1.0 if got == int(prompt.answer) else self.format_reward

    def sft_examples(self, seed: int) -> Iterator[tuple[str, str]]:
        noise = random.Random(f"sft-label-noise/{seed}")  # independent of the problem stream
        for p in self.train_prompts(seed):
            answer = int(p.answer)
            if noise.random() < self.sft_label_noise:
                answer += 1
            yield p.text, str(answer)
