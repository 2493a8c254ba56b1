"""A submission's way in, in two locked phases around reward scoring (controller.py).

`check_submission` (under the controller's lock) validates every group against the lease,
the configured limits and the prompt ids the controller builds itself
(bridge/control/validation.py) and changes nothing but the worker's liveness. The caller
then scores the fresh groups with the lock released (bridge/control/rewards.py), and
`accept` (under the lock again) buffers the scored groups atomically. A checked submission
renews its worker's leases past the worst-case scoring time (one timeout per completion),
so scoring never expires them; a lease that ended anyway (released, the worker quarantined)
is refused with 409 (its groups were requeued); a group
buffered meanwhile by a concurrent resubmission of the same lease counts as a duplicate.
`ctl` is the `Controller`; these are its methods, kept here to keep controller.py small.
"""

from __future__ import annotations

from bridge.control.protocol import Submission, SubmitResponse
from bridge.control.validation import SubmissionError, check_group
from bridge.tasks import Prompt


def check_submission(ctl, worker_id: str, sub: Submission):
    """(fresh groups, group_id -> Prompt); raises SubmissionError before any change."""
    c, now = ctl.config, ctl.clock()
    ctl.store.expire_leases(now)
    ctl._touch(worker_id)
    lease = ctl._own_lease(worker_id, sub.lease_id)
    rows = {r["group_id"]: r for r in ctl.store.groups_of_lease(sub.lease_id)}
    ids = [g.group_id for g in sub.groups]
    if len(set(ids)) != len(ids):
        raise SubmissionError("a group id appears twice in the submission")
    newest = ctl._announcement().version
    fresh, prompts = [], {}
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
        check_group(
            g,
            prompt_id=row["prompt_id"],
            n=c.group_size,
            sampling=ctl.content.sampling,
            vocab_size=c.vocab_size,
            max_prompt_tokens=c.max_prompt_tokens,
            newest_version=newest,
            prompt_token_ids=ctl.content.prompt_ids(row["prompt"]),
            episode=ctl.content.episode(row["answer"]),
        )
        fresh.append(g)
        prompts[g.group_id] = Prompt(row["prompt_id"], row["prompt"], row["answer"])
    if fresh:  # contact renews the leases, and scoring time must not expire them
        scoring_s = sum(len(g.trajectories) for g in fresh) * max(c.reward_timeout_s, 0.0)
        ctl.store.renew_leases(worker_id, now + c.lease_ttl_s + scoring_s)
    return fresh, prompts


def accept(ctl, worker_id: str, sub: Submission, scored) -> SubmitResponse:
    """Buffer the scored groups still leased to `sub` (the lease may have expired while
    they were scored: 409); the rest of `sub` are duplicates."""
    c, now = ctl.config, ctl.clock()
    ctl.store.expire_leases(now)
    lease = ctl._own_lease(worker_id, sub.lease_id)
    rows = {r["group_id"]: r for r in ctl.store.groups_of_lease(sub.lease_id)}
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
    for gid, trajs, _ in fresh:
        ctl.store.buffer_group(
            gid, [t.model_dump() for t in trajs], min(t.min_version for t in trajs), now
        )
    if fresh:
        ctl.store.incr("groups/accepted", len(fresh))
        ctl.store.incr("trajectories/accepted", c.group_size * len(fresh))
        ctl.store.incr("reward/errors", sum(e for _, _, e in fresh))
        ctl.store.incr("reward/timeouts", sum(
            t.reward_error.startswith("RewardTimeout") for _, ts, _ in fresh for t in ts
        ))  # fmt: skip
    accepted = {gid for gid, _, _ in fresh}
    dups = [g.group_id for g in sub.groups if g.group_id not in accepted]
    ctl.store.incr("groups/duplicate", len(dups))
    if lease["state"] == "active" and not any(
        r["state"] == "leased" for r in ctl.store.groups_of_lease(sub.lease_id)
    ):
        ctl.store.set_lease_state(sub.lease_id, "done")
        step = ctl.store.get("next_step", 0)
        late = any(step - min(t.min_version for t in ts) > c.staleness
                   for _, ts, _ in fresh)  # fmt: skip
        ctl.timing.lease_done(worker_id, lease["created_at"], now, late)
        # Every group of the lease is in now: its rollouts over its issue -> done time.
        done = len(ctl.store.groups_of_lease(sub.lease_id))
        ctl.fleet.lease_done(worker_id, lease["created_at"], now, done * c.group_size)
    ctl._new_work.notify_all()
    return SubmitResponse(
        accepted=[gid for gid, _, _ in fresh],
        duplicates=dups,
        announcement=ctl._announcement(),
        swap_to=ctl._swap_to(ctl.store.worker(worker_id)["version"]),
    )
