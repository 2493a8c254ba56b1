"""Rewards on the trusted side: the controller scores every submitted completion itself.

    scorer = RewardScorer(task, codec, timeout_s=5.0)      # codec: bridge.contracts.prompt
    trajs, errors = scorer.score_group(prompt, worker_trajectories)

A worker sends completion token ids only; the text the reward sees is those ids decoded
with the run's tokenizer (`ScoringText`), and the reference answer never leaves the
controller's database.

Hidden tokens (issue 23 item 7). The model's vocabulary is padded past the tokenizer's (the
tiny model: 128 ids, 99 tokens), and a decoder that skips special tokens or unknown ids
would read "4<pad>2" as "42": a token the reward cannot see could join or split an answer.
So a single-turn completion may hold only ids the tokenizer knows, that
are not special and that decode to something, except one stop token at its end (EOS, or
PAD where the run stops on it). Any other completion scores `REWARD_ON_ERROR` with
`reward_error` "HiddenToken: ..." (counted in `reward/hidden_tokens` and against the worker
by the service, `WorkerRegistry.count_hidden`; not in `reward/errors`, which counts a reward
function that failed). Scored 0 rather than refused: an honest
policy samples padded ids too (an untrained tiny model spreads 29/128 of its mass over
them), and a 0 teaches it not to, while a refusal would requeue the prompt forever.

A worker's own opinion of its reward is not even on the wire (bridge/control/protocol.py).

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
the model would otherwise be trained on a context the environment never produced). An
environment that draws from outside (seed, actions) (a nondeterministic tool,
`Environment.deterministic` False) was played here turn by turn (POST /v1/episode), and
its replay takes back what the controller drew when it answered (`drawn`, recorded with
the episode's state): the observations and the reward are the ones the controller
answered with, and a worker's environment tokens that differ from them are refused alike.

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

import numpy as np

from bridge.contracts import thinking
from bridge.control.intake import token_arrays
from bridge.control.intake.validation import SubmissionError
from bridge.control.protocol import Trajectory, WorkerTrajectory
from bridge.control.trust.log_text import log_safe
from bridge.tasks import EnvTask, Prompt, RewardError, Task, cached_task, score
from bridge.tasks.chat_turns import cut_turn_close
from bridge.tasks.env import replay_named
from bridge.tasks.reward_pool import fn_name

REWARD_ON_ERROR = 0.0


class Codec(Protocol):
    """bridge.contracts.prompt.TextCodec: `tok` is its `tokenizers.Tokenizer`."""

    tok: object
    eos_id: int
    pad_id: int

    def encode_prompt(self, text: str) -> list[int]: ...

    def decode(self, ids) -> str: ...


class HiddenToken(RewardError):
    """A completion holds a token the reward would not see (module docstring)."""


# Ids below this are looked up in a table (`hidden_flags`): past every tokenizer's vocabulary
# (the largest in use have ~260 K ids), small enough that the table is at most 4 MiB.
_TABLE_IDS = 1 << 22


class ScoringText:
    """The text a reward sees: ids decoded with nothing skipped, once no id is hidden."""

    def __init__(self, codec: Codec):
        self.tok = codec.tok
        self.stops = {i for i in (codec.eos_id, codec.pad_id) if i is not None}
        added = self.tok.get_added_tokens_decoder()
        self.special = {i for i, t in added.items() if t.special}
        self._why: dict[int, str] = {}  # id -> why hidden ('' = visible); ids are few
        self._table = np.zeros(0, np.int8)  # id -> 1 hidden, 0 visible, -1 not asked yet

    def hidden(self, i: int) -> str:
        """Why id `i` is invisible to a reward, or ''."""
        why = self._why.get(i)
        if why is None:
            if self.tok.id_to_token(i) is None:
                why = "outside the tokenizer's vocabulary"
            elif i in self.special:
                why = "a special token"
            elif not self.tok.decode([i], skip_special_tokens=False):
                why = "decodes to nothing"
            else:
                why = ""
            self._why[i] = why
        return why

    def hidden_flags(self, ids: np.ndarray) -> np.ndarray:
        """Whether each id of the int array `ids` is hidden: a table lookup, `hidden`
        asked once per id the table has not seen (a completion repeats few ids)."""
        if ids.size == 0:
            return np.zeros(0, bool)
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= _TABLE_IDS:  # not a tokenizer's id: one question per distinct id
            distinct, where = np.unique(ids, return_inverse=True)
            hidden = np.array([bool(self.hidden(int(i))) for i in distinct], dtype=bool)
            return hidden[where.reshape(ids.shape)]
        if high >= len(self._table):  # -1: not asked yet
            self._table = np.concatenate(
                [self._table, np.full(high + 1 - len(self._table), -1, np.int8)]
            )
        looked_up = self._table[ids]
        if (looked_up < 0).any():
            for i in np.unique(ids[looked_up < 0]).tolist():
                self._table[i] = bool(self.hidden(i))
            looked_up = self._table[ids]
        return looked_up == 1

    def text(self, ids) -> str:
        """The decoded text; HiddenToken unless every id (but a final stop) is visible."""
        a = None if token_arrays.short(ids) else token_arrays.int_array(ids)
        if a is None:  # short, or ids past int64 (`hidden` words why): token by token
            return self._text_per_token(ids)
        body = a[:-1] if len(a) and int(a[-1]) in self.stops else a
        if (pos := token_arrays.first(self.hidden_flags(body))) is not None:
            i = int(body[pos])
            raise HiddenToken(f"completion token {pos} (id {i}) is {self.hidden(i)}")
        return self.tok.decode(body.tolist(), skip_special_tokens=False)

    def _text_per_token(self, ids) -> str:
        body = self._body(ids)
        if (pos := self._first_hidden(body)) is not None:
            i = body[pos]
            raise HiddenToken(f"completion token {pos} (id {i}) is {self.hidden(i)}")
        return self.tok.decode(body, skip_special_tokens=False)

    def _body(self, ids) -> list[int]:
        """The ids but a final stop id."""
        ids = [int(i) for i in ids]
        return ids[:-1] if ids and ids[-1] in self.stops else ids

    def _first_hidden(self, body: list[int]) -> int | None:
        return next((pos for pos, i in enumerate(body) if self.hidden(i)), None)

    def count_hidden(self, trajectories: Sequence[WorkerTrajectory]) -> int:
        """How many of `trajectories` hold a hidden token in a model turn (`text`'s rule
        per model turn: a stop id ending the turn is not hidden), without decoding."""
        n = 0
        for t in trajectories:
            ids = t.completion_token_ids
            ids = None if token_arrays.short(ids) else token_arrays.int_array(ids)
            if ids is None:  # short, or ids past int64: the per-turn rule, token by token
                n += self._count_hidden_slow(t)
                continue
            model = np.ones(len(ids), bool)
            if t.completion_mask is not None:
                model = np.asarray(t.completion_mask, dtype=np.int64) == 1
            # The last token of each model turn, where a stop id is allowed.
            turn_end = model & ~np.append(model[1:], False)
            stop = np.isin(ids, np.fromiter(self.stops, np.int64, len(self.stops)))
            n += bool(np.any(self.hidden_flags(ids) & model & ~(turn_end & stop)))
        return n

    def _count_hidden_slow(self, t: WorkerTrajectory) -> int:
        turns = (self._body(ids) for m, ids in t.segments() if m == 1)
        return int(any(self._first_hidden(body) is not None for body in turns))


class UnterminatedThinking(RewardError):
    """A think block that never closed: no answer (bridge/contracts/thinking.py)."""


class CallPool(Protocol):
    """What `bridge.tasks.reward_pool.RewardPool` offers (the seam for another runner)."""

    def call(self, fn, *args, timeout_s: float | None = None, imports=(), **kwargs): ...


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
        self.decoder = ScoringText(codec)
        self._pool = pool
        # Reasoning models (task.thinking): the answer is the text after the last </think>.
        fmt, template = getattr(codec, "fmt", None), getattr(codec, "chat_template", None)
        self.thinks = thinking.scores_after_think(fmt, template)
        self._close_id = codec.tok.token_to_id(thinking.CLOSE) if self.thinks else None

    def answer(self, t: WorkerTrajectory, text: str) -> tuple[str, int]:
        """(the text the reward sees, thinking tokens) of one decoded completion;
        UnterminatedThinking when its think block never closed."""
        if not self.thinks:
            return text, 0
        prompt = self.codec.tok.decode(list(t.prompt_token_ids), skip_special_tokens=False)
        opened = thinking.opens_thinking(prompt)
        parts = thinking.split(text, opened)
        n = thinking.think_tokens(t.completion_token_ids, parts, self._close_id, self.codec.encode)
        if not parts.terminated:
            raise UnterminatedThinking(f"no {thinking.CLOSE} after {n} thinking tokens")
        return parts.answer, n

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
        value = _checked(
            self.pool.call(score_text, *args, p, text, timeout_s=self.timeout_s, imports=args[:1])
        )
        if isinstance(value, RewardError):
            raise value
        return value

    def replay(
        self, prompt: Prompt, actions: list[str], drawn: list | None = None
    ) -> tuple[float, list[str], bool, list]:
        """The environment task's replay of one episode: (reward, observations, done, what
        each step drew); `drawn`: what its first steps drew when the controller played them
        (taken back, not drawn again)."""
        t = self.task
        if self.timeout_s <= 0:
            r = t.episode(prompt, actions, drawn or ())
            return r.reward, r.observations, r.done, r.drawn
        # The environment's module registers it in the pool's process (an env defined
        # outside bridge.tasks works too).
        args = (type(t.env).__module__, t.name, dict(t.options))
        p = (prompt.prompt_id, prompt.text, prompt.answer)
        out = self.pool.call(
            replay_named, *args, p, actions, drawn or None, timeout_s=self.timeout_s,
            imports=args[:1],
        )  # fmt: skip
        reward, observations, done, draws = out
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            raise RewardError(f"replay returned {type(reward).__name__}, not a number")
        return float(reward), list(observations), bool(done), list(draws)

    def episode_reward(
        self, group_id: int, prompt: Prompt, t: WorkerTrajectory, drawn: list | None = None
    ) -> float:
        """Replay the episode from (seed, decoded model turns, what the controller drew
        when it played them: `drawn`); the environment tokens must be exactly the replay's
        observations as this side encodes them, else 422 (the worker made them up).
        RewardError when the environment itself fails."""
        segments = t.segments()
        # Actions are read as the environment's own parser reads them (an unreadable action
        # gets the environment's invalid-action rule). Not the hidden-token rule: scoring 0
        # would be a gain where rewards are negative (a lost hand is -2), so a hidden id in a
        # model turn is only counted against the worker (service.py).
        turns = [ids for m, ids in segments if m == 1]
        actions = [self.codec.decode(ids) for ids in turns]
        shown = [ids for m, ids in segments if m == 0]
        reward, observations, done, _ = self.replay(prompt, actions, drawn)
        where = f"group {group_id} sample {t.sample_index}"
        if len(observations) < len(actions):
            raise SubmissionError(
                f"{where}: the episode ended after {len(observations)} model turns, "
                f"the trajectory has {len(actions)}"
            )
        for i, ids in enumerate(shown):
            # A turn the token budget cut is closed first (chat_turns.py `cut_turn_close`).
            close = cut_turn_close(self.task.env, turns[i], self.codec.encode)
            expected = self.codec.encode(close + observations[i])
            if ids != expected:
                raise SubmissionError(
                    f"{where}: environment tokens after model turn {i + 1} differ from the "
                    f"replay's observation {observations[i]!r} ({len(ids)} vs "
                    f"{len(expected)} tokens)"
                )
        return reward

    def rewards(self, prompt: Prompt, texts: list[str]) -> list[float | RewardError]:
        """Each text's reward, or the RewardError it got. One pool call for them all (a
        call per completion was ~30% of the controller's GIL at 500 workers; issue 25,
        stop 36) under the sum of their timeouts; if that call fails as a whole (a reward
        hung, its worker died), each text again in a call of its own, so a hang or a crash
        is charged to its own completion, as before."""
        if self.timeout_s <= 0 or len(texts) <= 1:
            return [self._reward_or_error(prompt, text) for text in texts]
        t = self.task
        args = (type(t).__module__, t.name, dict(t.options))
        p = (prompt.prompt_id, prompt.text, prompt.answer)
        try:
            results = self.pool.call(
                score_texts, *args, p, texts, timeout_s=self.timeout_s * len(texts),
                imports=args[:1],
            )  # fmt: skip
        except RewardError:
            return [self._reward_or_error(prompt, text) for text in texts]
        return [_checked(value) if ok else RewardError(value) for ok, value in results]

    def _reward_or_error(self, prompt: Prompt, text: str) -> float | RewardError:
        try:
            return self.reward(prompt, text)
        except RewardError as e:
            return e

    def score_group(
        self,
        group_id: int,
        prompt: Prompt,
        trajectories: Sequence[WorkerTrajectory],
        drawn: dict[int, list] | None = None,
    ) -> tuple[list[Trajectory], int]:
        """(scored trajectories, how many failed to score); never raises on a reward, but
        raises SubmissionError (422) for an episode the environment's replay contradicts.
        A single-turn completion is the one-step case: one model turn, no replay; the
        group's texts are scored in one pool call (`rewards`). `drawn`: sample index ->
        what the controller drew playing that episode (`episode_reward`)."""
        drawn = drawn or {}
        episodic = isinstance(self.task, EnvTask)
        outcomes = []  # per trajectory: [reward or RewardError or the text to score, why, think]
        for t in trajectories:
            think = 0
            try:
                if episodic:
                    reward = self.episode_reward(group_id, prompt, t, drawn.get(t.sample_index))
                    outcomes.append([reward, "", 0])
                    continue
                text = self.decoder.text(t.completion_token_ids)
                text, think = self.answer(t, text)
                outcomes.append([text, "", think])
            except UnterminatedThinking as e:  # the policy's own doing: 0, not a failure
                why = f"UnterminatedThinking: {e}"
                outcomes.append([REWARD_ON_ERROR, why, len(t.completion_token_ids)])
            except HiddenToken as e:
                # An honest policy samples a hidden id now and then (an untrained model,
                # the padded vocabulary): scored 0 and counted by the service
                # (reward/hidden_tokens), not a reward failure nor a console warning.
                outcomes.append([REWARD_ON_ERROR, log_safe(f"HiddenToken: {e}", 1000), think])
            except RewardError as e:  # the environment's replay failed
                outcomes.append([e, "", think])
        pending = [o for o in outcomes if isinstance(o[0], str)]
        for o, value in zip(pending, self.rewards(prompt, [o[0] for o in pending]), strict=True):
            o[0] = value
        out, errors = [], 0
        for t, (value, why, think) in zip(trajectories, outcomes, strict=True):
            if isinstance(value, RewardError):
                # The reward's message may quote the completion: escaped for the log.
                value, why = REWARD_ON_ERROR, log_safe(f"{type(value).__name__}: {value}", 1000)
                if not errors:
                    logging.warning(
                        "group %d sample %d: reward failed (scored %.1f): %s",
                        group_id,
                        t.sample_index,
                        REWARD_ON_ERROR,
                        why,
                    )
                errors += 1
            out.append(scored_trajectory(t, value, why, think))
        return out, errors


# A trajectory's token-long lists: validated once, with the submission that brought them.
_TOKEN_LISTS = (
    "prompt_token_ids",
    "completion_token_ids",
    "logprobs",
    "versions",
    "completion_mask",
)


def scored_trajectory(t: WorkerTrajectory, reward, reward_error: str, think: int) -> Trajectory:
    """`Trajectory(**t.model_dump(), reward=..., ...)` without copying and validating `t`'s
    token lists a second time (~5 ms of GIL a maximum-length completion): every other
    field, the score's included, is validated as that call would (a one-token stand-in for
    each list), then the lists the submission's validation built are put back. Short
    lists are cheaper copied than worked around (token_arrays.ARRAY_MIN)."""
    lists = {k: getattr(t, k) for k in _TOKEN_LISTS}
    if all(v is None or token_arrays.short(v) for v in lists.values()):
        return Trajectory(**t.model_dump(), reward=reward, reward_error=reward_error,
                          think_tokens=think)  # fmt: skip
    stand_in = {k: None if v is None else v[:1] for k, v in lists.items()}
    fields = t.model_dump(exclude=set(_TOKEN_LISTS))
    checked = Trajectory(
        **fields, **stand_in, reward=reward, reward_error=reward_error, think_tokens=think
    )
    return Trajectory.model_construct(**{**dict(checked), **lists})


def score_texts(
    module: str, task_name: str, options: dict, prompt: tuple[str, str, str], texts: list[str]
) -> list[tuple[bool, float | str]]:
    """Runs in a reward-pool worker: `score_text` of each text, as (True, reward) or
    (False, the error as the pool words a raising call)."""
    out = []
    for text in texts:
        try:
            out.append((True, score_text(module, task_name, options, prompt, text)))
        except BaseException as e:  # noqa: BLE001 - a reward function may raise anything
            out.append((False, f"{fn_name(score_text)} raised {type(e).__name__}: {e}"))
    return out


def _checked(value) -> float | RewardError:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return RewardError(f"reward worker returned {type(value).__name__}, not a number")
    return float(value)
