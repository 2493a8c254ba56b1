"""The controller's metrics line: fleet, capacity and cost (fleet_plan.py), admission,
request limits, broadcast, group counts and the cumulative counters. The caller holds the
controller's lock and transaction."""

from __future__ import annotations

# Cumulative counters (db.incr) reported in every stats line.
COUNTERS = """staleness/dropped groups/accepted groups/consumed groups/duplicate
trajectories/accepted leases/issued leases/expired leases/released reward/errors
reward/timeouts fleet/quarantined audit/dropped_groups""".split()


def stats_line(now: float, db, fleet, policy_version: int, capacity: int, limits, broadcast):
    out = {
        **fleet.stats(now, db.get("trajectories/accepted", 0)),
        "policy_version/published": policy_version,
        "admission/capacity": capacity,
        **limits.stats(),
        **broadcast.stats(now),
    }
    for state in ("queued", "leased", "buffered"):
        out[f"groups/{state}"] = db.count(state)
    for key in COUNTERS:
        out[key] = db.get(key, 0)
    return out
