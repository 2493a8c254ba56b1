"""Multi-turn environments: the interface, their registry, and the task view of one.

    @register_env("kuhn_poker")
    class KuhnPoker(Environment):
        def reset(self, seed: int) -> str: ...              # the first observation
        def step(self, action: str) -> tuple[str, float, bool]: ...   # (obs, reward, done)

Registering an environment also registers a task of the same name (`EnvTask`), so
`task.name=kuhn_poker` trains on it with nothing else to write. An episode:

    prompt ids = BOS + encode(reset(seed))      (the controller builds them, like any prompt)
    model turn 1 (loss mask 1) | encode(obs 1) (mask 0) | model turn 2 (mask 1) | ...

until `done` or `max_turns` model turns. The model's tokens stay exactly as sampled; each
observation is encoded on its own without special tokens (`TextCodec.encode` on the
controller, `tokenizer.encode(text, add_special_tokens=False)` on a worker), and the action
the environment sees is a model turn's tokens decoded with special tokens skipped. Both
sides thus agree token for token, which the controller checks on every submission.

Trust: the episode's reward is the sum of the step rewards of a REPLAY on the trusted side
(`replay`, in the reward pool): reset(seed), then step through the decoded actions. A
worker runs its own copy of the environment only to produce the observations; it sends no
reward, and observation tokens that differ from the replay's are refused (422). Envs must
therefore be deterministic functions of (seed, actions): draw any randomness (an opponent's
mixed strategy, the deck) from `random.Random(seed)`, never from global state.

The exception is an environment that draws from outside (seed, actions) on purpose: a tool
that reads the clock, a fresh random draw, the web (`deterministic = False`). No replay can
recompute what it drew, so it runs on the trusted side only (its lease carries no seed:
controller mode, bridge/control/intake/episode_steps.py), and the controller records what
each step drew when it answered (`drawn()`); every later replay of the episode takes the
recorded draws back (`redraw`) instead of drawing again, so its observations and reward are
the ones the controller answered with, and a worker's environment tokens that differ from
them are refused as for any episode.

An episode cut short (the token budget or `max_turns` ran out before `done`) scores the
rewards so far plus `unfinished_reward()` (default 0): an env where stalling must not pay
(poker: a hand left unplayed) overrides it.

A single-turn task is the one-step case: one model segment, no environment tokens.
"""

from __future__ import annotations

import abc
import dataclasses
import hashlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from bridge.contracts.prompt import PromptFormat
from bridge.tasks.base import Prompt, RewardError, Task
from bridge.tasks.registry import register_task

_ENVS: dict[str, Callable[..., Environment]] = {}
_SEED_SPACE = 1 << 62  # episode seeds are in [0, 2**62): JSON- and SQLite-safe integers


class Environment(abc.ABC):
    """One episode at a time; `reset` starts a new one. Deterministic in (seed, actions)."""

    name: str = ""
    # True when the seed is hidden state (a poker deal): the worker never sees it and every
    # observation comes from the controller. False: the prompt shows everything the seed
    # decides (a question), so the lease carries the seed and the worker plays the
    # environment itself; the trusted side still replays every episode.
    hidden_state: bool = True
    # False: a step may draw from outside (seed, actions) (module docstring); the trusted
    # side then plays every step and replays from what it recorded (`drawn`, `redraw`).
    deterministic: bool = True

    @abc.abstractmethod
    def reset(self, seed: int) -> str:
        """Start the episode `seed`; returns the first observation (the prompt text)."""

    @abc.abstractmethod
    def step(self, action: str) -> tuple[str, float, bool]:
        """Apply the model's action text; (next observation, reward of this step, done).
        The observation after `done` is informational (never shown to the model)."""

    def drawn(self) -> Any:
        """What the last `step` drew from outside (seed, actions), as JSON data (None:
        nothing; always None for a deterministic environment)."""
        return None

    def redraw(self, drawn: Any) -> None:
        """Make the next `step` take `drawn` (a record of `drawn()`) instead of drawing."""
        raise NotImplementedError(f"environment {self.name!r} draws nothing to take back")

    def unfinished_reward(self) -> float:
        """Extra reward when the episode ends before `done` (budget or max_turns)."""
        return 0.0

    def invalid(self, action: str) -> bool:
        """True when `action` is no action of the game (the environment still applies its
        rule for it, e.g. a fold); the task option `illegal_penalty` fines such turns."""
        return False

    def exact_eval(self) -> ExactEval | None:
        """The policy's exact expected reward, for small games (None: not available)."""
        return None

    def demonstrations(self, seed: int) -> Iterator[tuple[str, str]]:
        """SFT examples (first observation, action), e.g. a format-only warm start."""
        return iter(())


@dataclasses.dataclass(frozen=True)
class ExactEval:
    """An environment whose every decision is one token can be evaluated exactly: the
    learner reads the policy's next-token distribution at each decision point off one
    forward pass, sums it per action (every vocabulary token decoded and `parse`d, as the
    environment parses an action: "c" and "C" are the same check), and `value` turns
    that into the expected reward per episode.

    `transcripts[i]` is the text at decision point i, [obs, action, obs, ..., obs] (the
    model's earlier actions included as one-token texts); `parse(text)` the action a
    one-token text means, or None; `value(probs)` takes one {action: probability} per
    point (the mass on no action is whatever the environment does with an invalid
    action); `optimum` the best expected reward any policy reaches."""

    transcripts: list[list[str]]
    parse: Callable[[str], str | None]
    value: Callable[[list[dict[str, float]]], float]
    optimum: float


def register_env(name: str, **task_defaults: Any):
    """Class decorator: registers the environment and a task `name` built on it
    (`task_defaults` are the task's default options, e.g. max_turns)."""

    def deco(cls):
        if name in _ENVS:
            raise ValueError(f"environment {name!r} registered twice")
        cls.name = name
        _ENVS[name] = cls

        def factory(**options):
            return EnvTask(name, **{**task_defaults, **options})

        register_task(name)(factory)
        return cls

    return deco


def available_envs() -> list[str]:
    return sorted(_ENVS)


def make_env(name: str, **options: Any) -> Environment:
    if name not in _ENVS:
        raise KeyError(f"unknown environment {name!r}; registered: {sorted(_ENVS)}")
    return _ENVS[name](**options)


@dataclasses.dataclass(frozen=True)
class Replay:
    """What the environment said along one episode: `observations[i]` follows action i;
    `drawn[i]` is what step i drew from outside (seed, actions) (`Environment.drawn`)."""

    reward: float
    observations: list[str]
    done: bool
    step_rewards: list[float]
    drawn: list[Any] = dataclasses.field(default_factory=list)


def replay(
    env: Environment,
    seed: int,
    actions: Sequence[str],
    illegal_penalty: float = 0.0,
    drawn: Sequence[Any] = (),
) -> Replay:
    """Run an episode from (seed, actions). It stops at `done`: actions beyond it are not
    applied (fewer observations than actions tells the caller they were made up). Each
    applied action the environment calls `invalid` costs `illegal_penalty` (in its step's
    reward). `drawn[i]` (recorded when step i was first played) is what step i takes back
    instead of drawing again; steps past `drawn` draw."""
    env.reset(seed)
    observations, rewards, draws, done = [], [], [], False
    for i, action in enumerate(actions):
        if done:
            break
        fine = illegal_penalty if illegal_penalty and env.invalid(action) else 0.0
        if i < len(drawn) and drawn[i] is not None:
            env.redraw(drawn[i])
        obs, r, done = env.step(action)
        draws.append(env.drawn())
        r = float(r) - fine
        if not done and not obs:
            raise RewardError(f"environment {env.name!r} returned an empty observation")
        observations.append(obs)
        rewards.append(float(r))
    total = sum(rewards) + (0.0 if done else float(env.unfinished_reward()))
    return Replay(total, observations, done, rewards, draws)


def _penalty(value: Any) -> float:
    try:
        penalty = float(value)
    except (TypeError, ValueError):
        penalty = float("nan")
    if not 0.0 <= penalty < float("inf"):
        raise ValueError(f"illegal_penalty must be a finite number >= 0, got {value!r}")
    return penalty


def _seed(label: str, index: int) -> int:
    digest = hashlib.sha256(f"{label}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % _SEED_SPACE


class EnvTask(Task):
    """The task view of an environment: a prompt is an episode seed, its text the first
    observation, its reward the episode's (replayed) reward.

    Options: `max_turns` (model turns per episode), `turn_max_tokens` (tokens per model
    turn; the run's `batch.max_answer_len` bounds the whole episode), `eval_size` (held-out
    episodes, seeds from their own label so they never appear in training), `env_options`
    (a dict passed to the environment's constructor); any other option goes to the
    environment too, except `illegal_penalty` (default 0): chips taken off the TRAINING
    reward for each model turn the environment calls `invalid` (the format penalty of LLM
    RL; the environment's own rule for such text still applies, and `exact_eval`, which
    measures the game itself, ignores it). Prompt ids are `<env>/<digest of the seed>`;
    `answer` holds the seed, which only the trusted side sees: leases carry no seed, and
    workers get each observation from the controller (bridge/control/intake/episode_steps.py).
    """

    hides_state = True  # the seed is the episode's hidden state (a deal); per env below

    def __init__(
        self,
        env: str,
        max_turns: int = 8,
        turn_max_tokens: int = 8,
        eval_size: int = 64,
        env_options: dict | None = None,
        illegal_penalty: float = 0.0,
        **options: Any,
    ):
        if max_turns < 1 or turn_max_tokens < 1:
            raise ValueError(f"need max_turns >= 1 and turn_max_tokens >= 1 for {env!r}")
        self.illegal_penalty = _penalty(illegal_penalty)
        self.name = self.env_name = env
        self.env_options = {**(env_options or {}), **options}
        self.max_turns, self.turn_max_tokens = int(max_turns), int(turn_max_tokens)
        self.eval_size = int(eval_size)
        self.env = make_env(env, **self.env_options)  # fails here on bad options
        # An environment that draws from outside (seed, actions) is played by the trusted
        # side only: what it drew is recorded there, never taken from a worker.
        self.hides_state = bool(self.env.hidden_state) or not self.env.deterministic
        tools = getattr(self.env, "tool_schemas", None)
        if tools is not None and getattr(self.env.turns, "template", None):
            # Tools are declared through the chat template (its `tools=`), as a chat
            # model's prompt declares them.
            self.prompt_format = PromptFormat("chat", tools=tools())

    def new_env(self) -> Environment:
        return make_env(self.env_name, **self.env_options)

    def prompt_id(self, seed: int) -> str:
        """`<env>/<digest of the seed>`: a prompt id goes to workers, the seed (the deal)
        must not (the trusted side keeps it in `answer`). Opaque because the controller's
        training seeds are secret (`hides_state`): a digest of a public seed could be
        looked up in the public stream."""
        return (
            f"{self.env_name}/{hashlib.sha256(f'{self.env_name}/{seed}'.encode()).hexdigest()[:16]}"
        )

    def _prompt(self, seed: int) -> Prompt:
        return Prompt(self.prompt_id(seed), self.env.reset(seed), str(seed))

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        # Each episode seed a hash of (stream seed, index), not a Mersenne Twister draw: the
        # twister is linear, so the seat and card of enough prompts (seed % 12) would give
        # away its state, and with it every later deal, even from a secret stream seed.
        for i in itertools.count():
            yield self._prompt(_seed(f"{self.env_name}/train/{seed}", i))

    def eval_prompts(self) -> list[Prompt]:
        return [self._prompt(_seed(f"{self.env_name}/eval", i)) for i in range(self.eval_size)]

    @staticmethod
    def seed_of(prompt: Prompt) -> int:
        return int(prompt.answer)

    def episode(self, prompt: Prompt, actions: Sequence[str], drawn: Sequence = ()) -> Replay:
        return replay(self.new_env(), self.seed_of(prompt), actions, self.illegal_penalty, drawn)

    def reward(self, prompt: Prompt, completion: str) -> float:
        """The one-step case: the completion is the first (and only) action."""
        return self.episode(prompt, [completion]).reward

    def sft_examples(self, seed: int) -> Iterator[tuple[str, str]]:
        return self.new_env().demonstrations(seed)

    def exact_eval(self) -> ExactEval | None:
        """The environment's exact evaluation; only when a turn is a single token (then
        the action probabilities at each decision point are the whole policy)."""
        return self.env.exact_eval() if self.turn_max_tokens == 1 else None


def replay_named(
    module: str,
    task_name: str,
    options: dict,
    prompt: tuple[str, str, str],
    actions: list[str],
    drawn: list | None = None,
) -> tuple[float, list[str], bool, list]:
    """Runs in a reward-pool worker (bridge/control/intake/rewards.py): the trusted replay of one
    episode of the task (name, options) as plain data, so only strings cross the pipe:
    (reward, observations, done, what each step drew)."""
    import importlib
    import sys

    from bridge.tasks.registry import cached_task

    if module not in sys.modules and module != "__main__":
        importlib.import_module(module)
    task = cached_task(task_name, options)
    if not isinstance(task, EnvTask):
        raise RewardError(f"task {task_name!r} is not an environment task")
    r = task.episode(Prompt(*prompt), actions, drawn or ())
    return r.reward, r.observations, r.done, r.drawn
