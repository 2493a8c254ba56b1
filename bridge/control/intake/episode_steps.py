"""Multi-turn observations from the controller, turn by turn, on state the controller holds.

A lease carries no episode seed (`EpisodeSpec.seed` -1: the seed of a poker hand is the
deal); the worker asks POST /v1/episode for the next observation of each live episode of
its lease, sending the model turns so far (token ids as sampled). The controller checks the
lease (the worker's, active, the group still leased to it, a sample index of the group,
turns within the episode's limits), decodes the turns as its scoring replay does and
replays the environment from the seed it keeps (bridge/tasks/env.py `replay`, in the reward
pool with the reward timeout, RewardScorer.replay). It answers the last observation, or
`done` (without the final observation: the worker has no use for it); never a reward,
never the seed.

The trusted side holds each leased episode's state: the model turns answered so far, the
last observation, whether it is done and what each answered turn drew from outside (seed,
actions) (SQLite `episodes`, keyed by the lease, written in the answer's transaction, gone
when the lease ends). An environment that draws (a nondeterministic tool: a clock, a
random draw, the web; `Environment.deterministic` False) is played here only: each replay
takes the committed turns' draws back and draws only for the new turn, so the episode the
worker sees is one the controller answered, and its submission is scored from those
records (rewards.py). A worker could otherwise probe: play
one line, read what it reveals of the hidden state (a check that the opponent answers with
a bet shows its card is not the Queen), then play and submit another. So:
- a request extends each episode it names by exactly one turn, after the committed ones;
  any other turns (a rewind, a different line, two turns at once) are refused (409 / 422)
  and nothing is replayed. Repeating the committed turns (a retry) returns the committed
  answer, without a replay.
- an episode appears at most once per request: one request replays an episode once.
- replays cost the worker's budget, `episode_replays_per_s` sustained and
  `episode_replay_burst` at once (bridge/control/trust/limits.py's token bucket; 429 with
  Retry-After past it), so no worker can keep the reward pool from the others.
- the answer is committed under the controller's lock only if the episode's state is still
  the one the replay started from (two concurrent requests cannot both probe); else 409.
- a submitted episode's model turns must be exactly its committed turns (the submission's
  check, intake.py `check_played`): every turn of a leased episode is played here.

An evaluation lease (eval_leases.py) holds its episodes' states in its own row, in memory
like the lease (its groups are leased as single-turn, so its results carry one turn). The
submission is also checked as before: the scoring replay compares every environment
token of the trajectory with the replay's observations (rewards.py).
"""

from __future__ import annotations

from bridge.control.intake.intake import own_lease
from bridge.control.intake.validation import SubmissionError
from bridge.control.protocol import (
    EpisodeObservation,
    EpisodeStep,
    EpisodeStepResponse,
    EpisodeTurns,
)
from bridge.control.trust.limits import RateLimiter
from bridge.tasks import Prompt
from bridge.tasks.base import RewardError
from bridge.tasks.chat_turns import cut_turn_close


class OverBudget(SubmissionError):
    """The worker's replay budget is spent: 429, ask again after `wait_s`."""

    status = 429

    def __init__(self, wait_s: float):
        super().__init__(f"episode replay budget spent: ask again in {wait_s:.3f} s")
        self.wait_s = wait_s


class EpisodeSteps:
    """A part of `Controller` (`Controller.episode_step`), built from its parts: the
    database, its lock, the config, the lease content, the codec, the scorer and the eval
    board (eval leases' episodes live in their rows there)."""

    def __init__(self, db, lock, config, content, codec, scorer, evals=None):
        self.db, self.lock, self.config = db, lock, config
        self.content, self.codec, self.scorer, self.evals = content, codec, scorer, evals
        self.budget = RateLimiter(config.episode_replays_per_s, config.episode_replay_burst)

    def _eval_leased(self, worker_id: str, lease_id: str) -> tuple[dict, dict]:
        """`_leased` of an evaluation lease (in memory, eval_leases.py: its episode states
        live in the lease's row and go with it); call under the board's lock."""
        ev = self.evals
        lease = ev.leases.get(lease_id)
        if lease is None or lease["worker"] != worker_id:
            raise SubmissionError(f"no active eval lease {lease_id} of yours", 404)
        rows = [ev.groups.get(g) for g in lease["groups"]]
        return {
            r["group"].group_id: (r["prompt"], r["group"].n)
            for r in rows
            if r and r["state"] == "leased"
        }, lease.setdefault("episodes", {})

    def _leased(self, worker_id: str, lease_id: str) -> tuple[dict, dict]:
        """(group id -> (Prompt, n) of the groups `lease_id` (the worker's, active) holds,
        the lease's committed episode states); call under the controller's lock."""
        lease = own_lease(self.db, worker_id, lease_id)
        if lease["state"] != "active":
            raise SubmissionError(f"lease {lease_id!r} is {lease['state']}", 409)
        n = self.config.group_size
        rows = {
            r["group_id"]: (Prompt(r["prompt_id"], r["prompt"], r["answer"]), n)
            for r in self.db.groups_of_lease(lease_id)
            if r["state"] == "leased"
        }
        return rows, self.db.episode_states(lease_id)

    def _check(self, e: EpisodeTurns, rows: dict) -> Prompt:
        """The episode's prompt, if `e` is a leased episode's turns within its limits."""
        c, max_turn = self.config, self.content.sampling.max_tokens
        where = f"group {e.group_id} sample {e.sample_index}"
        prompt, n = rows.get(e.group_id, (None, 0))
        if prompt is None:
            raise SubmissionError(f"{where}: not leased to you by this lease", 409)
        spec = self.content.episode(prompt.answer)
        if spec is None:
            raise SubmissionError(f"{where}: not an episode")
        if e.sample_index >= n:
            raise SubmissionError(f"{where}: sample_index >= the group's n {n}")
        if len(e.turns) > spec.max_turns:
            raise SubmissionError(f"{where}: {len(e.turns)} turns > {spec.max_turns}")
        for ids in e.turns:
            if not 1 <= len(ids) <= max_turn:
                raise SubmissionError(f"{where}: a turn of {len(ids)} tokens (1..{max_turn})")
            if any(not 0 <= i < c.vocab_size for i in ids):
                raise SubmissionError(f"{where}: a token id outside [0, {c.vocab_size})")
        if sum(map(len, e.turns)) > spec.max_tokens:
            raise SubmissionError(f"{where}: turns longer than max_tokens {spec.max_tokens}")
        return prompt

    @staticmethod
    def _next(e: EpisodeTurns, state: tuple | None) -> bool:
        """Whether `e` plays one new turn after the committed `state` (False: it repeats
        the committed turns); SubmissionError for any other turns."""
        where = f"group {e.group_id} sample {e.sample_index}"
        played, _, done, _ = state or ([], "", False, [])
        if e.turns == played:
            return False
        if e.turns[: len(played)] != played:
            raise SubmissionError(
                f"{where}: these turns do not continue the {len(played)} already played "
                "(an episode cannot be rewound)",
                409,
            )
        if done:
            raise SubmissionError(f"{where}: the episode ended after {len(played)} model turns")
        if len(e.turns) != len(played) + 1:
            raise SubmissionError(
                f"{where}: {len(e.turns) - len(played)} new turns; one at a time, after the "
                f"{len(played)} played"
            )
        return True

    def _replay(self, e: EpisodeTurns, prompt: Prompt, drawn: list) -> tuple[str, bool, list]:
        """(the last observation, done, what each turn drew) of `e`'s turns, the committed
        turns taking back what they drew (`drawn`)."""
        where = f"group {e.group_id} sample {e.sample_index}"
        actions = [self.codec.decode(ids) for ids in e.turns]
        try:
            _, observations, done, draws = self.scorer.replay(prompt, actions, drawn)
        except RewardError as e2:
            raise SubmissionError(f"{where}: the environment failed: {e2}", 500) from e2
        if len(observations) < len(actions):
            raise SubmissionError(
                f"{where}: the episode ended after {len(observations)} model turns"
            )
        if done:
            return "", done, draws
        # A turn the token budget cut is closed first (chat_turns.py `cut_turn_close`).
        close = cut_turn_close(self.scorer.task.env, e.turns[-1], self.codec.encode)
        return close + observations[-1], done, draws

    def observe(self, worker_id: str, req: EpisodeStep) -> EpisodeStepResponse:
        """The next observation of each episode of `req` (SubmissionError otherwise)."""
        if self.scorer is None:
            raise SubmissionError("this controller has no tokenizer: no episodes", 503)
        keys = [(e.group_id, e.sample_index) for e in req.episodes]
        if len(set(keys)) != len(keys):
            raise SubmissionError("an episode appears twice in the request")
        ev = self.evals
        in_db = ev is None or not ev.owns(req.lease_id)  # else an evaluation lease
        lock, leased = (self.lock, self._leased) if in_db else (ev._lock, self._eval_leased)
        with lock:
            rows, states = leased(worker_id, req.lease_id)
            states = dict(states)  # what the replays start from
        prompts = [self._check(e, rows) for e in req.episodes]
        played = [
            (e, p, states[k][3] if k in states else [])
            for e, p, k in zip(req.episodes, prompts, keys, strict=True)
            if self._next(e, states.get(k))
        ]
        replays = self._replays(worker_id, played)
        fresh = {
            (e.group_id, e.sample_index): EpisodeObservation(observation=o, done=d)
            for (e, _, _), (o, d, _) in zip(played, replays, strict=True)
        }
        new = {
            (e.group_id, e.sample_index): ([list(t) for t in e.turns], o, d, draws)
            for (e, _, _), (o, d, draws) in zip(played, replays, strict=True)
        }
        if new and in_db:
            with self.lock, self.db.tx():
                self._commit(*self._leased(worker_id, req.lease_id), states, new)
                self.db.put_episode_states(req.lease_id, new)
            self.db.sync()  # durable before the answer, as every controller operation
        elif new:
            with lock:
                rows, now = leased(worker_id, req.lease_id)
                self._commit(rows, now, states, new)
                now.update(new)
        return EpisodeStepResponse(
            observations=[
                fresh.get(k) or EpisodeObservation(observation=states[k][1], done=states[k][2])
                for k in keys
            ]
        )

    @staticmethod
    def _commit(rows: dict, now: dict, states: dict, new: dict) -> None:
        """Refuse (409) to commit `new` unless each of its episodes is still leased and
        still in the state its replay started from (`states`): of two requests playing
        one episode at once, one line is answered, never both."""
        for k in new:
            if k[0] not in rows or now.get(k) != states.get(k):
                raise SubmissionError(f"group {k[0]} sample {k[1]}: played meanwhile", 409)

    def _replays(self, worker_id: str, played: list) -> list[tuple[str, bool, list]]:
        """Replay each (turns, prompt, drawn) of `played`, within the worker's budget."""
        if played and (wait := self.budget.take(worker_id, len(played))) > 0:
            raise OverBudget(wait)
        return [self._replay(*x) for x in played]
