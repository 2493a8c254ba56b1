"""Caps on what one worker may hold, from what the controller measured, never its own word
(issue 23 item 9).

Age: each heartbeat renews a worker's leases by `lease_ttl_s`, so a worker that heartbeats
and never submits held its prompts forever. A lease now also has an absolute age cap,
`AGE_FACTOR` x the worker's own measured lease latency (issue -> last submission of its
completed leases, the EMA of lease_timing.py), at least `MIN_AGE_TTLS` x `lease_ttl_s` (a
loaded machine); until the worker completed a lease, `FIRST_AGE_TTLS` x `lease_ttl_s` (a
first lease may compile the engine). Past it the lease expires like an unrenewed one: its
groups go back to the front of the queue (counted in `leases/too_old`). Not the fleet's
latency for an unmeasured worker: an honest worker slower than the fleet would then lose
every lease before it could be measured, and the too-slow rule (lease_timing.py) is what
handles slow workers; the concurrency cap below bounds what an unmeasured one holds.

Concurrency: the groups a worker may hold at once are capped by the rollouts it returned,
not by its declared `max_concurrent_sequences` (still an upper bound): before its first
completed lease at most `max_groups_per_lease` (one lease's worth), after it what its
measured rate (accepted rollouts/s, fleet_plan.py) returns within `lease_ttl_s`, at least
one group. A worker declaring a huge concurrency cannot take the prompt queue.
"""

from __future__ import annotations

import math

AGE_FACTOR = 4.0  # x the measured lease latency
MIN_AGE_TTLS = 3.0  # x lease_ttl_s, the least a lease may live
FIRST_AGE_TTLS = 20.0  # x lease_ttl_s while no lease was measured at all


def max_lease_age_s(own_latency_s: float | None, lease_ttl_s: float) -> float:
    """The absolute age past which a lease expires whatever the heartbeats say."""
    if own_latency_s is None:
        return FIRST_AGE_TTLS * lease_ttl_s
    return max(MIN_AGE_TTLS * lease_ttl_s, AGE_FACTOR * own_latency_s)


def max_groups_held(
    declared_sequences: int,
    measured_rollouts_per_s: float | None,
    *,
    group_size: int,
    lease_ttl_s: float,
    max_groups_per_lease: int,
) -> int:
    """How many groups a worker may hold leased at once (see the module docstring)."""
    declared = max(1, declared_sequences // group_size)
    if not measured_rollouts_per_s or measured_rollouts_per_s <= 0:
        return min(declared, max(1, max_groups_per_lease))
    measured = math.ceil(measured_rollouts_per_s * lease_ttl_s / group_size)
    return min(declared, max(1, measured))
