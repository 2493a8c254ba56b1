"""The bounded-staleness rule, stated once: which versions may be leased, admitted, consumed.

Every part that applies the rule calls these functions: the controller (admission, its
SQLite drop of stale groups, intake's "came back late", the too-slow deadline in
lease_timing.py), the planner's fleet validation and simulator (bridge/plan), and the
learner's config validation (learner_jax/run_config.py). tests/bridge/control/
staleness_rule_test.py sweeps S and checks that the controller and the simulator admit and
drop the same cases.

Versions. Version v = the parameters after v updates; learner step t trains on a batch and
then produces version t + 1. A trajectory's staleness at step t is t - v for its oldest
token (a group is judged by its stalest trajectory: GRPO needs it whole). With the bound S

    step t may consume version v  iff  t - v <= S,

so version v is usable by the S + 1 steps v, v + 1, ..., v + S (`usable_steps`), and a
group of version v has `batches_left(v, t, S) = v + S - t + 1` learner batches left when the
learner's next step is t; it is fresh while that is positive.

Admission (the controller's lease cap). With g groups per step, a group leased at version x
with `ahead` groups leased or buffered before it is consumed at step t + floor(ahead / g) at
the latest (batches go oldest version first, then by arrival), so its staleness is at most
(t - x) + floor(ahead / g), which is <= S iff ahead < batches_left(x, t, S) * g. So a lease
at version x may bring leased + buffered up to

    admission_capacity = max(0, batches_left(x, t, S) * g).

Counting every outstanding group, also newer ones it will overtake, keeps the groups
admitted earlier fresh too: for a group at v > x the same sum is below its own, looser
bound. The simulator's "controller" admission (a worker at most m versions behind the
newest P works as if at P - m) is the same cap at x = P - m.

Lease deadline (lease_timing.py). The learner takes one batch per step period T; the batch
of step v + S, the last one that can use version v, is taken about batches_left(v, t, S) * T
after the previous batch, so a lease issued `since` seconds after that batch must come back
within batches_left * T - since.

Partial rollouts (`rollout.partial="continue"`). A worker that hears of a newer version
mid-lease pauses, swaps it in and continues its unfinished samples under it, each token
tagged with the version that sampled it, so a group's tokens span versions oldest..newest.
Such a group is judged by

    group_version = min(newest, oldest + S_max + 1)        (`group_version`)

in place of its oldest token: the version that completed it, as long as no token is more
than S_max + 1 versions older than that. So at step t every token of a consumed group is at
most S + S_max + 1 <= 2 S_max + 1 versions old, and the store keeps 2 S_max + 3 versions
(`versions_kept`), so the audit and the exact check can still read every version a token
names. Why the newest token: the worker ran each of its samples on the newest version it had
at every moment, so a late group is late because it is long, not because it was generated
on old weights; dropping it is what starved long answers. The older tokens stay off-policy,
and the loss corrects each by its own behaviour log-prob (per-token importance weights);
the cap keeps that correction's lag bounded. docs/design/staleness.md has the numbers.

Schedule. Only multiples of publish_every (kappa) are published, so step t can count on no
version newer than t - (kappa - 1): with S < kappa - 1 (`min_staleness`) some step never
gets a fresh batch and the learner waits forever.

Atomicity (issue 25). The controller serves requests concurrently; what keeps this rule and
exactly-once true is one small critical section, the controller's lock around one SQLite
transaction (`Controller._op`, bridge/control/controller.py). Each invariant, and where:
- "a group is leased once, within the admission cap": `Leasing.offer` (leasing.py) reads
  the leased + buffered count and moves `queued` rows to `leased` under the new lease id in
  that one transaction; offers are serialized by the lock, so no row goes out twice and no
  two offers both see the same room.
- "a lease is granted once and ends once": its `leases` row is inserted in the offer's
  transaction and synced before the reply; it leaves `active` exactly once, by one UPDATE
  under the lock (`set_lease_state`: done, released, expired, rolled back; db_leases.py).
  Its deadline lives in memory (`LeaseDeadlines`, db_leases.py): expiry takes a lease out
  of that table under the table's own lock, the lock a heartbeat's renewal takes, so a
  lease is renewed or expired, never both; the table's changes inside a transaction are
  undone with it on rollback.
- "a group is accepted once": `Intake.accept` (intake.py) re-reads the group's row under the
  lock after scoring: only a row still `leased` to the submitting lease is buffered; one
  already buffered or consumed is a duplicate (a no-op), any other state a 409.
- "a group is consumed once": `LearnerSide.take_batch` (learner_api.py) moves `buffered`
  rows to `consumed` in the batch's transaction, and the batch reaches the learner only
  after that commit is on disk (group commit).
Everything slow or frequent runs outside the critical section: parsing and the JSON bounds
(http_guard.py), authentication and heartbeats (hot state in memory with their own small
locks, bridge/control/state/hot_state.py), reward scoring, and the fsync of the group commit
(bridge/control/state/group_commit.py). Lock order: the controller's lock, then the SQLite
transaction, then a small lock (deadline table, hot workers, standby cache, broadcast,
pacing); no small lock is held while the controller's lock is taken, so none deadlocks.
"""

from __future__ import annotations


def usable_steps(staleness: int) -> int:
    """How many learner steps can consume one version: v, v + 1, ..., v + S."""
    return staleness + 1


def batches_left(version: int, next_step: int, staleness: int) -> int:
    """Learner batches (from step `next_step` on) that may still consume `version`."""
    return usable_steps(staleness) - (next_step - version)


def is_fresh(version: int, step: int, staleness: int) -> bool:
    """Learner step `step` may consume a trajectory whose oldest token is of `version`."""
    return batches_left(version, step, staleness) > 0


def oldest_fresh(step: int, staleness: int) -> int:
    """The oldest version learner step `step` may consume, the one with one batch left
    (for SQL: `min_version < this` is stale)."""
    return step - usable_steps(staleness) + 1


def admission_capacity(version: int, next_step: int, staleness: int, groups_per_step: int) -> int:
    """How many groups may be leased + buffered for a lease generated at `version` and
    still be fresh when consumed (module docstring)."""
    return max(0, batches_left(version, next_step, staleness) * groups_per_step)


def admits(held: int, version: int, next_step: int, staleness: int, groups_per_step: int) -> bool:
    """A lease at `version` may add a group to `held` leased + buffered groups."""
    return held < admission_capacity(version, next_step, staleness, groups_per_step)


def lease_window_s(
    version: int, next_step: int, staleness: int, step_period_s: float, since_batch_s: float
) -> float:
    """Seconds a lease at `version`, issued `since_batch_s` after the last batch, may take
    and still be consumed fresh, the learner taking one batch per `step_period_s`."""
    return batches_left(version, next_step, staleness) * step_period_s - since_batch_s


PARTIAL_MODES = ("off", "continue")


def group_version(oldest: int, newest: int, partial: str, staleness_max: int) -> int:
    """The version the bound judges a group by (module docstring, "Partial rollouts"):
    its oldest token's (`partial` "off"), or its newest token's while no token is more than
    `staleness_max` + 1 versions older ("continue")."""
    if partial == "off":
        return oldest
    if partial == "continue":
        return min(newest, oldest + staleness_max + 1)
    raise ValueError(f"rollout.partial={partial!r}; one of {PARTIAL_MODES}")


def versions_kept(staleness_max: int, partial: str) -> int:
    """How many newest versions the weight store keeps: every version a token of a group
    that is still fresh may name, and one more (the version being published), so the audit
    and the exact check can read each."""
    extra = staleness_max + 1 if partial == "continue" else 0
    return staleness_max + 2 + extra


def min_staleness(publish_every: int) -> int:
    """The smallest S with which every step can get a fresh batch (module docstring)."""
    return publish_every - 1


def schedule_error(staleness: int, publish_every: int) -> str | None:
    """Why (S, kappa) cannot train, or None: the one check of run_config and the planner."""
    if publish_every < 1 or staleness < 0:
        return f"need publish_every >= 1 and staleness >= 0, got {publish_every}, {staleness}"
    if staleness < min_staleness(publish_every):
        return (
            f"staleness {staleness} < publish_every - 1 = {min_staleness(publish_every)}: the "
            "learner would wait forever for versions that are never published"
        )
    return None
