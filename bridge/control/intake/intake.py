"""A submission's way in: unlocked checks, reward scoring, one locked phase (controller.py).

`Intake` is a part of `Controller`, built from the database, the config, the clock and the
lease content it checks against; it never references the controller. `check` (no lock:
committed rows through `ControllerDB.read_view`; issue 25, stop 36) validates every group
against the lease, the configured limits and the prompt ids the controller builds itself
(bridge/control/intake/validation.py), the version the lease was taken at (a token tagged older
than it is refused) and, for an episode, the turns its worker played through POST
/v1/episode (episode_steps.py), and changes nothing but lease deadlines. The caller then
scores the fresh groups (bridge/control/intake/rewards.py), and `accept` (under the lock) re-reads
the groups' states and buffers the scored groups atomically. A checked submission renews its
worker's leases not yet past their deadline beyond the worst-case scoring time (two
timeouts per completion, rewards.py), so scoring never expires them; a lease that ended
anyway (expired before the check, released, the worker quarantined) is refused with 409
(its groups were requeued); a group buffered meanwhile by a concurrent resubmission of the
same lease counts as a duplicate. `accept` returns what the caller feeds to the lease
timing and the fleet plan when the lease is complete (`LeaseDone`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pydantic

from bridge.contracts import staleness as staleness_rule
from bridge.control.config import ControllerConfig
from bridge.control.intake.validation import SubmissionError, check_group
from bridge.control.leasing.lease_content import LeaseContent
from bridge.control.protocol import GroupResult, Submission, Trajectory
from bridge.control.state.db import ControllerDB
from bridge.tasks import Prompt

_TRAJECTORY = pydantic.TypeAdapter(Trajectory)


def group_json(trajectories: list[Trajectory]) -> str:
    """A group's payload: the JSON list of its trajectories, as
    `TypeAdapter(list[Trajectory]).dump_json` writes it (Rust: ~10x model_dump+json), one
    trajectory per call: a call holds the GIL throughout, and a maximum-size group in one
    call held it 0.1-0.4 s (loaded box), every heartbeat waiting; one trajectory ~2 ms."""
    return "[" + ",".join(_TRAJECTORY.dump_json(t).decode() for t in trajectories) + "]"


def own_lease(db: ControllerDB, worker_id: str, lease_id: str):
    """The lease row, if it exists and belongs to `worker_id` (else 404 / 403)."""
    lease = db.lease(lease_id)
    if lease is None:
        raise SubmissionError(f"unknown lease {lease_id!r}", 404)
    if lease["worker_id"] != worker_id:
        raise SubmissionError(f"lease {lease_id!r} belongs to another worker", 403)
    return lease


def check_played(states: dict, group: GroupResult) -> None:
    """Refuse (422) a submitted episode whose model turns are not the turns its worker
    played through POST /v1/episode (`states`: the lease's committed episode states,
    `ControllerDB.episode_states`; episode_steps.py)."""
    for t in group.trajectories:
        turns = [list(ids) for m, ids in t.segments() if m == 1]
        played = states.get((group.group_id, t.sample_index), ([],))[0]
        if turns != played:
            raise SubmissionError(
                f"group {group.group_id} sample {t.sample_index}: its {len(turns)} model "
                f"turns are not the {len(played)} played through POST /v1/episode"
            )


def judged_version(trajectories, config: ControllerConfig) -> int:
    """The version the staleness bound judges a group by: its oldest token's, or with
    partial rollouts the newest token's within a cap (bridge/contracts/staleness.py
    `group_version`). Buffered as the group's `min_version`, the column the drop rule and
    the batch order read."""
    oldest = min(t.min_version for t in trajectories)
    newest = max(max(t.versions) for t in trajectories)
    s_max = max(config.staleness, config.staleness_max)
    return staleness_rule.group_version(oldest, newest, config.partial, s_max)


@dataclasses.dataclass(frozen=True)
class LeaseDone:
    """Every group of a lease is in: its issue time, whether any came back too stale to be
    used (lease_timing's evidence), and how many rollouts it brought (fleet_plan's)."""

    issued_at: float
    late: bool
    rollouts: int


class Intake:
    def __init__(
        self,
        db: ControllerDB,
        config: ControllerConfig,
        clock: Callable[[], float],
        content: LeaseContent,
    ):
        self.db, self.config, self.clock, self.content = db, config, clock, content

    def check(self, worker_id: str, sub: Submission, newest: int, db: ControllerDB):
        """(fresh groups, group_id -> Prompt, group_id -> {sample index: what the episode
        drew when the controller played it} for episodes played through POST /v1/episode,
        the scoring's records: rewards.py); raises SubmissionError before any change.
        `newest`: the newest published version (no token may claim a newer one). `db`:
        `read_view()` of the store, no lock: what this reads of a lease (its owner, its
        groups' prompts, its version) does not change once it is granted, and `accept`
        re-reads the groups' states under the lock."""
        c, now = self.config, self.clock()
        lease = own_lease(db, worker_id, sub.lease_id)
        rows = {r["group_id"]: r for r in db.groups_of_lease(sub.lease_id)}
        ids = [g.group_id for g in sub.groups]
        if len(set(ids)) != len(ids):
            raise SubmissionError("a group id appears twice in the submission")
        fresh, prompts, played, drawn = [], {}, None, {}
        for g in sub.groups:
            row = rows.get(g.group_id)
            if row is None:
                raise SubmissionError(
                    f"group {g.group_id} is not (or no longer) part of lease "
                    f"{sub.lease_id!r} (state {lease['state']}); it was requeued",
                    409,
                )
            if row["state"] in ("buffered", "consumed"):
                continue  # a duplicate, reported by accept
            episode = self.content.episode(row["answer"])
            check_group(
                g,
                prompt_id=row["prompt_id"],
                n=c.group_size,
                sampling=self.content.sampling,
                vocab_size=c.vocab_size,
                max_prompt_tokens=c.max_prompt_tokens,
                newest_version=newest,
                lease_version=db.get(f"lease_version/{sub.lease_id}"),
                prompt_token_ids=self.content.prompt_ids(row["prompt"]),
                episode=episode,
                routing=c.routing,
            )
            if episode is not None and episode.seed < 0:  # played through POST /v1/episode
                if played is None:
                    played = db.episode_states(sub.lease_id)
                check_played(played, g)
                drawn[g.group_id] = {
                    t.sample_index: played.get((g.group_id, t.sample_index), ((),) * 4)[3]
                    for t in g.trajectories
                }
            fresh.append(g)
            prompts[g.group_id] = Prompt(row["prompt_id"], row["prompt"], row["answer"])
        if fresh:  # contact renews the leases, and scoring time must not expire them
            # A group is scored in one pool call under its completions' timeouts, then, if
            # that call failed, one call per completion (rewards.py): twice their sum.
            n = sum(len(g.trajectories) for g in fresh)
            scoring_s = 2 * n * max(c.reward_timeout_s, 0.0)
            db.renew_leases(worker_id, now + c.lease_ttl_s + scoring_s, now)  # not the past
        return fresh, prompts, drawn

    def accept(self, worker_id: str, sub: Submission, scored):
        """Buffer the scored groups still leased to `sub` (the lease may have expired while
        they were scored: 409); the rest of `sub` are duplicates. Returns (accepted group
        ids, duplicate group ids, LeaseDone or None)."""
        c, now, db = self.config, self.clock(), self.db
        db.expire_leases(now)
        lease = own_lease(db, worker_id, sub.lease_id)
        rows = {r["group_id"]: r for r in db.groups_of_lease(sub.lease_id)}
        fresh = []
        for gid, trajs, errors in scored:
            state = rows[gid]["state"] if gid in rows else "requeued"
            if state == "leased":
                fresh.append((gid, trajs, errors))
            elif state not in ("buffered", "consumed"):  # not a concurrent resubmission's
                raise SubmissionError(
                    f"group {gid}: lease {sub.lease_id!r} ended while its rewards were "
                    f"computed (state {lease['state']}); it was requeued",
                    409,
                )
        judged = {gid: judged_version(trajs, c) for gid, trajs, _ in fresh}  # read twice
        for gid, trajs, _ in fresh:
            db.buffer_group(gid, group_json(trajs), judged[gid], now)
        if fresh:
            db.incr("groups/accepted", len(fresh))
            db.incr("trajectories/accepted", c.group_size * len(fresh))
            db.incr("reward/errors", sum(e for _, _, e in fresh))
            db.incr("reward/timeouts", sum(
                t.reward_error.startswith("RewardTimeout") for _, ts, _ in fresh for t in ts
            ))  # fmt: skip
        accepted = [gid for gid, _, _ in fresh]
        dups = [g.group_id for g in sub.groups if g.group_id not in set(accepted)]
        db.incr("groups/duplicate", len(dups))
        done = None
        # The lease's rows as read above less what this call buffered (nothing else moves
        # them under the lock): one read of the lease's groups per acceptance, not three.
        leased = {gid for gid, r in rows.items() if r["state"] == "leased"} - set(accepted)
        if lease["state"] == "active" and not leased:
            db.set_lease_state(sub.lease_id, "done")
            step = db.get("next_step", 0)
            late = not all(
                staleness_rule.is_fresh(judged[gid], step, c.staleness) for gid, _, _ in fresh
            )
            # Every group of the lease is in now: its rollouts over its issue -> done time.
            rollouts = len(rows) * c.group_size
            done = LeaseDone(lease["created_at"], late, rollouts)
        return accepted, dups, done
