"""Rewards on the trusted side: the controller scores every submitted completion itself.

    scorer = RewardScorer(task, codec, timeout_s=5.0)      # codec: bridge.contracts.prompt
    trajs, errors = scorer.score_group(prompt, worker_trajectories)

A worker sends completion token ids only; the text the reward sees is those ids decoded
with the run's tokenizer, special tokens skipped (`TextCodec.decode`), and the reference
answer never leaves the controller's database. A worker's own opinion of its reward is not
even on the wire (bridge/control/protocol.py).

Reward functions are user code (a `task.reward_fn` file, math-verify on a pathological
string), so none runs in the HTTP request's thread unguarded: each call goes to the
killable process pool `bridge.tasks.reward_pool` with a per-call timeout, and the
controller calls `score_group` outside its lock, so a slow reward holds up only the
submission that needs it. The child rebuilds the task by name and options
(`tasks.cached_task`, cached per process; it imports the task class's module first, so a
task registered outside bridge.tasks works too), so only strings cross the pipe.

Multi-turn episodes (bridge/tasks/env.py) are scored by replaying the environment in the same
pool from the episode's seed and the model turns decoded here: the replay's reward is the
episode's, and its observations, encoded here with the run's tokenizer, must equal the
environment tokens the worker put between the turns (else the submission is refused, 422:
the model would otherwise be trained on a context the environment never produced).

Failure policy: a completion whose reward raises, returns a non-number or times out gets
reward 0.0 (`Trajectory.reward_error` says why) and counts in `reward/errors`; the group is
still accepted. Requeueing instead would loop on a prompt the reward cannot score, and a
completion that crashes or hangs the reward function is exactly what the policy should not
learn to produce, so the floor reward is the conservative choice. A group whose every
completion failed has equal rewards and so carries no gradient (its advantages are 0). A
reward function broken for every input shows as `reward/errors` growing with
`groups/accepted`, and the first error of each group is logged.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Protocol

from bridge.control.protocol import Trajectory, WorkerTrajectory
from bridge.control.validation import SubmissionError
from bridge.tasks import EnvTask, Prompt, RewardError, Task, cached_task, score
from bridge.tasks.env import replay_named

REWARD_ON_ERROR = 0.0


class Codec(Protocol):
    def encode_prompt(self, text: str) -> list[int]: ...

    def decode(self, ids) -> str: ...


class CallPool(Protocol):
    """What `bridge.tasks.reward_pool.RewardPool` offers (the seam for another runner)."""

    def call(self, fn, *args, timeout_s: float | None = None, **kwargs): ...


def score_text(
    module: str, task_name: str, options: dict, prompt: tuple[str, str, str], text: str
) -> float:
    """Runs in a reward-pool worker: the task's reward of one completion text. `module`
    defines the task class; importing it registers a task defined outside bridge.tasks."""
    if module not in sys.modules and module != "__main__":
        importlib.import_module(module)
    return score(cached_task(task_name, options), Prompt(*prompt), text)


class RewardScorer:
    """Scores completions for one task: decode, then the task's reward under a timeout.

    `timeout_s <= 0` scores inline (no process, no timeout): for tests of other parts only.
    """

    def __init__(
        self, task: Task, codec: Codec, timeout_s: float = 5.0, pool: CallPool | None = None
    ):
        self.task, self.codec, self.timeout_s = task, codec, float(timeout_s)
        self._pool = pool

    @property
    def pool(self) -> CallPool:
        if self._pool is None:
            from bridge.tasks.reward_pool import default_pool

            self._pool = default_pool()
        return self._pool

    def reward(self, prompt: Prompt, text: str) -> float:
        """One reward; RewardError (RewardTimeout past the timeout) on any failure."""
        if self.timeout_s <= 0:
            return score(self.task, prompt, text)
        t = self.task
        args = (type(t).__module__, t.name, dict(t.options))
        p = (prompt.prompt_id, prompt.text, prompt.answer)
        value = self.pool.call(score_text, *args, p, text, timeout_s=self.timeout_s)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RewardError(f"reward worker returned {type(value).__name__}, not a number")
        return float(value)

    def replay(self, prompt: Prompt, actions: list[str]) -> tuple[float, list[str], bool]:
        """The environment task's replay of one episode: (reward, observations, done)."""
        t = self.task
        if self.timeout_s <= 0:
            r = t.episode(prompt, actions)
            return r.reward, r.observations, r.done
        # The environment's module registers it in the pool's process (an env defined
        # outside bridge.tasks works too).
        args = (type(t.env).__module__, t.name, dict(t.options))
        p = (prompt.prompt_id, prompt.text, prompt.answer)
        out = self.pool.call(replay_named, *args, p, actions, timeout_s=self.timeout_s)
        reward, observations, done = out
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise RewardError(f"replay returned {type(reward).__name__}, not a number")
        return float(reward), list(observations), bool(done)

    def episode_reward(self, group_id: int, prompt: Prompt, t: WorkerTrajectory) -> float:
        """Replay the episode from (seed, decoded model turns); the environment tokens must
        be exactly the replay's observations as this side encodes them, else 422 (the
        worker made them up). RewardError when the environment itself fails."""
        segments = t.segments()
        actions = [self.codec.decode(ids) for m, ids in segments if m == 1]
        shown = [ids for m, ids in segments if m == 0]
        reward, observations, done = self.replay(prompt, actions)
        where = f"group {group_id} sample {t.sample_index}"
        if len(observations) < len(actions):
            raise SubmissionError(
                f"{where}: the episode ended after {len(observations)} model turns, "
                f"the trajectory has {len(actions)}"
            )
        for i, ids in enumerate(shown):
            expected = self.codec.encode(observations[i])
            if ids != expected:
                raise SubmissionError(
                    f"{where}: environment tokens after model turn {i + 1} differ from the "
                    f"replay's observation {observations[i]!r} ({len(ids)} vs "
                    f"{len(expected)} tokens)"
                )
        return reward

    def score_group(
        self, group_id: int, prompt: Prompt, trajectories: Sequence[WorkerTrajectory]
    ) -> tuple[list[Trajectory], int]:
        """(scored trajectories, how many failed to score); never raises on a reward, but
        raises SubmissionError (422) for an episode the environment's replay contradicts.
        A single-turn completion is the one-step case: one model turn, no replay."""
        out, errors = [], 0
        episodic = isinstance(self.task, EnvTask)
        for t in trajectories:
            try:
                if episodic:
                    value, why = self.episode_reward(group_id, prompt, t), ""
                else:
                    text = self.codec.decode(t.completion_token_ids)
                    value, why = self.reward(prompt, text), ""
            except RewardError as e:
                value, why = REWARD_ON_ERROR, f"{type(e).__name__}: {e}"[:1000]
                if not errors:
                    logging.warning(
                        "group %d sample %d: reward failed (scored %.1f): %s",
                        group_id,
                        t.sample_index,
                        REWARD_ON_ERROR,
                        why,
                    )
                errors += 1
            out.append(Trajectory(**t.model_dump(), reward=value, reward_error=why))
        return out, errors
