"""What a task is (the data plane's contract): prompts, a reward, optional SFT examples.

Contract of a task:
- `train_prompts(seed)` an endless, deterministic iterator of `Prompt`s (same seed, same
  stream), so a restarted controller can skip what it already drew. `seed` is any int (a
  task that `hides_state` gets a 256-bit secret one).
- `eval_prompts()` a fixed held-out list, disjoint from the training stream.
- `reward(prompt, completion)` a float for one completion text (special tokens removed).
- `sft_examples(seed)` an iterator of (prompt text, target completion text), or nothing.
- `reward_detailed(prompt, completion)` optionally a float or a dict with "score" plus
  other numeric entries (verl's convention); the default is `reward` alone.

`score` wraps `reward` so a user's reward function that raises or returns a non-number
becomes a `RewardError` naming the task, never a crashed process. `score_detailed` also
returns the extra numbers as metrics (non-numeric extras are dropped: metrics are averaged).
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

from bridge.contracts.prompt import PromptFormat


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
    reward_override: Any = None  # a user_reward.RewardOverride when options replace the reward
    # How the prompt text is presented to the model (bridge/contracts/prompt.py); a config's
    # prompt.format overrides it. Plain text unless a task says otherwise.
    prompt_format: PromptFormat = PromptFormat()
    # True when a prompt's `answer` holds state the prompt text hides from workers (an
    # episode's seed is a card deal): the controller then draws `train_prompts` from a
    # seed keyed by the run's secret (bridge/control/leasing/prompt_stream.py), so no worker can
    # rebuild the stream from the config's public seed and look a prompt up in it.
    hides_state: bool = False

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

    def reward_detailed(self, prompt: Prompt, completion: str) -> float | dict[str, Any]:
        """The reward, or a dict with "score" and extra numbers to report as metrics."""
        return self.reward(prompt, completion)


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)


def score_detailed(task: Task, prompt: Prompt, completion: str) -> tuple[float, dict[str, float]]:
    """(reward, extra metrics) from `task.reward_detailed`; any failure is a RewardError."""
    where = f"task {task.name!r}"
    try:
        value = task.reward_detailed(prompt, completion)
    except RewardError as e:  # already says which function; keep its type (RewardTimeout)
        raise type(e)(f"{where}: {e} (prompt_id={prompt.prompt_id!r})") from e
    except Exception as e:  # noqa: BLE001 - a user's reward fn may raise anything
        raise RewardError(
            f"{where}: reward function raised {type(e).__name__}: {e} "
            f"(prompt_id={prompt.prompt_id!r})"
        ) from e
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        if "score" not in value:
            raise RewardError(f"{where}: reward dict has no 'score' key: {sorted(value)}")
        extras = {
            str(k): float(v)
            for k, v in value.items()
            if k != "score" and (_is_number(v) or isinstance(v, bool)) and math.isfinite(v)
        }
        value = value["score"]
    if not _is_number(value):
        raise RewardError(
            f"{where}: reward function returned {type(value).__name__} "
            f"{value!r}, not a number (prompt_id={prompt.prompt_id!r})"
        )
    if not math.isfinite(value):
        raise RewardError(f"{where}: reward {value} is not finite")
    return float(value), extras


def score(task: Task, prompt: Prompt, completion: str) -> float:
    """The task's reward as a finite float; any failure becomes a RewardError naming the task."""
    return score_detailed(task, prompt, completion)[0]
