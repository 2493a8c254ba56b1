"""Multi-turn observations from the controller, turn by turn (issue 23 item 8).

A lease used to carry each episode's seed, and the worker ran the environment itself: the
seed of a poker hand is the deal, so a worker could read the opponent's card (and the
deck) before its first move. Now the lease's `EpisodeSpec.seed` is -1, and the worker asks
POST /v1/episode for the next observation of each live episode of its lease, sending the
model turns so far (token ids as sampled). The controller checks the lease (the worker's,
active, the group still leased to it, a sample index of the group, turns within the
episode's limits), decodes the turns as its scoring replay does and replays the
environment from the seed it keeps (bridge/tasks/env.py `replay`, in the reward pool with
the reward timeout, RewardScorer.replay). It answers the last observation, or `done`
(without the final observation: the worker has no use for it); never a reward, never the
seed. Stateless: the replay from (seed, turns) is deterministic, so nothing is kept
between turns and a controller restart changes nothing. Cost: a replay of t turns at turn
t, which for card games of a few turns is microseconds next to a model turn.

The submission is checked as before: the scoring replay compares every environment token
of the trajectory with the replay's observations (rewards.py), so the worker still cannot
make observations up.
"""

from __future__ import annotations

from bridge.control.intake import own_lease
from bridge.control.protocol import EpisodeObservation, EpisodeStep, EpisodeStepResponse
from bridge.control.validation import SubmissionError
from bridge.tasks import Prompt
from bridge.tasks.base import RewardError


class EpisodeSteps:
    """Part of the controller's service; built from the controller's parts."""

    def __init__(self, db, lock, config, content, codec, scorer, evals=None):
        self.db, self.lock, self.config = db, lock, config
        self.content, self.codec, self.scorer, self.evals = content, codec, scorer, evals

    @classmethod
    def of(cls, ctl) -> EpisodeSteps:
        evals = getattr(ctl, "evals", None)  # eval leases (eval_leases.py), if any
        return cls(ctl.db, ctl.lock, ctl.config, ctl.content, ctl.codec, ctl.scorer, evals)

    def _leased(self, worker_id: str, lease_id: str) -> dict:
        """group id -> (Prompt, n) of the groups `lease_id` (the worker's, active) holds."""
        ev = self.evals
        if ev is not None and ev.owns(lease_id):  # an evaluation lease: held in memory
            with ev._lock:
                lease = ev.leases.get(lease_id)
                if lease is None or lease["worker"] != worker_id:
                    raise SubmissionError(f"no active eval lease {lease_id} of yours", 404)
                rows = [ev.groups.get(g) for g in lease["groups"]]
                return {
                    r["group"].group_id: (r["prompt"], r["group"].n)
                    for r in rows
                    if r and r["state"] == "leased"
                }
        n = self.config.group_size
        with self.lock:
            lease = own_lease(self.db, worker_id, lease_id)
            if lease["state"] != "active":
                raise SubmissionError(f"lease {lease_id!r} is {lease['state']}", 409)
            return {
                r["group_id"]: (Prompt(r["prompt_id"], r["prompt"], r["answer"]), n)
                for r in self.db.groups_of_lease(lease_id)
                if r["state"] == "leased"
            }

    def observe(self, worker_id: str, req: EpisodeStep) -> EpisodeStepResponse:
        """The next observation of each episode of `req` (SubmissionError otherwise)."""
        if self.scorer is None:
            raise SubmissionError("this controller has no tokenizer: no episodes", 503)
        rows = self._leased(worker_id, req.lease_id)
        c, max_turn = self.config, self.content.sampling.max_tokens
        out = []
        for e in req.episodes:
            where = f"group {e.group_id} sample {e.sample_index}"
            prompt, n = rows.get(e.group_id, (None, 0))
            if prompt is None:
                raise SubmissionError(f"{where}: not leased to you by {req.lease_id!r}", 409)
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
            actions = [self.codec.decode(ids) for ids in e.turns]
            try:
                _, observations, done = self.scorer.replay(prompt, actions)
            except RewardError as e2:
                raise SubmissionError(f"{where}: the environment failed: {e2}", 500) from e2
            if len(observations) < len(actions):
                raise SubmissionError(
                    f"{where}: the episode ended after {len(observations)} model turns"
                )
            out.append(EpisodeObservation(observation="" if done else observations[-1], done=done))
        return EpisodeStepResponse(observations=out)
