"""The chaos soak's liveness check: no stall longer than B, B derived from the fault schedule.

A stall is a gap between consecutive RL steps: the `time/wall` of consecutive metrics
lines (any binary run; a rerun's repeated steps count as steps), plus the gap from the
last line to the soak's end. Each gap may last

    B(gap) = base + sum over faults of what is left of each one's allowance at the gap

A fault at time t with allowance A leaves all of A to the gap it strikes within, and
t + A - (the gap's start) to a gap that starts after it, while that is positive: recovery
ends by t + A, whichever gap it falls in (a run stopped with SIGINT still logs the step
it was in, so its restart's gap starts just after the fault; a killed worker's leases hold
admission past the next step).

where `base` is the steady pace (5 x the median gap between steps, at least 30 s: the
held-out evaluation and checkpoint steps are slower than the median), and a fault's
allowance is what recovering from it must cost at most:

    binary_kill, binary_restart   2 x the first run's start (start to first RL step,
                                  measured in the same soak): a rerun does the same work
                                  plus a checkpoint restore
    worker_kill                   the lease TTL: the dead worker's leases hold admission
                                  until they expire
    sigstop                       the hold (lease TTL + 15 s) and the lease TTL after it
    corrupt                       per corrupted version: two heartbeats (the report reaches
                                  the controller) + the healer's first wait (a re-report)
                                  + the first run's start (the publish, every worker's swap)
    garbage, hostile_*            0: refused without touching the learner
    net_partition                 the cut (NET_PARTITION_S) and the lease TTL after it: the
                                  cut worker's leases hold admission until they expire
    net_flap                      the flapping (NET_FLAP down and up times) and two
                                  heartbeats: every worker loses the controller meanwhile
    net_slow                      the lease TTL: a lease of the slowed worker may expire

The soak's B is the largest B(gap) the schedule allows, over a window holding every fault;
the check fails on any gap past its own bound. Without healing, two corrupt head versions
stall the learner for the rest of the soak: the last gap outgrows every bound.

The check's answer carries everything it was computed from (`inputs`: the step times, each
fault's start time, the soak's end, the lease TTL, the first run's start, the corrupted
version count) and the fault schedule as run with each fault's allowance (`faults`), so a
finished soak's verdict can be recomputed from its JSON alone:

    python -m bench.chaos_stall F.json      # `recheck` of the soak's no_stall
"""

from __future__ import annotations

import json
import statistics
import sys

HEARTBEAT_S = 5.0  # bridge/control/config.py ControllerConfig.heartbeat_interval_s
HEAL_FIRST_WAIT_S = 10.0  # learner_jax/rl/heal.py VersionHealer.first_wait_s
NET_PARTITION_S = 20.0  # bench/chaos.py's net_partition: a worker's link down this long
NET_FLAP = (3, 2.0, 2.0)  # net_flap: the learner's uplink down `times` x down_s, up_s between
NET_SLOW_FACTOR = 10.0  # net_slow: a worker's uplink this many times slower


def allowances(lease_ttl_s: float, startup_s: float, corrupt_count: int) -> dict[str, float]:
    per_corrupt = 2 * HEARTBEAT_S + HEAL_FIRST_WAIT_S + startup_s
    return {
        "binary_kill": 2 * startup_s,
        "binary_restart": 2 * startup_s,
        "worker_kill": lease_ttl_s,
        "sigstop": 2 * lease_ttl_s + 15.0,
        "corrupt": corrupt_count * per_corrupt,
        "net_partition": NET_PARTITION_S + lease_ttl_s,
        "net_flap": NET_FLAP[0] * NET_FLAP[1] + (NET_FLAP[0] - 1) * NET_FLAP[2] + 2 * HEARTBEAT_S,
        "net_slow": lease_ttl_s,
    }


def base_s(walls: list[float]) -> float:
    gaps = [b - a for a, b in zip(walls, walls[1:], strict=False)]
    return max(30.0, 5 * statistics.median(gaps)) if gaps else 30.0


def _left(allowance: float, fault_at: float, gap_start: float) -> float:
    """What a fault's allowance leaves to a gap starting at `gap_start` (1 s of slack: a
    fault logged just before the step line that opens its gap strikes within it)."""
    if fault_at >= gap_start - 1.0:
        return allowance
    return max(0.0, fault_at + allowance - gap_start)


def check(
    walls: list[float],
    faults: list[tuple[float, str]],
    end_at: float,
    lease_ttl_s: float,
    startup_s: float,
    corrupt_count: int,
) -> dict:
    """`walls`: each RL metrics line's `time/wall`; `faults`: (epoch seconds, fault) as run;
    `end_at`: when the soak stopped the binary. Returns the check's verdict and numbers."""
    walls = sorted(walls)
    allow = allowances(lease_ttl_s, startup_s, corrupt_count)
    base = base_s(walls)
    worst, over = None, []
    edges = list(zip(walls, walls[1:] + [end_at], strict=True))
    for a, b in edges:
        left = [(f, _left(allow.get(f, 0.0), t, a)) for t, f in faults if t <= b]
        struck = [f for f, s in left if s > 0]
        bound = base + sum(s for _, s in left)
        row = {"from": round(a, 1), "gap_s": round(b - a, 1), "bound_s": round(bound, 1),
               "faults": struck}  # fmt: skip
        if worst is None or row["gap_s"] - bound > worst["gap_s"] - worst["bound_s"]:
            worst = row
        if b - a > bound:
            over.append(row)
    every = base + sum(allow.get(f, 0.0) for _, f in faults)
    longest = max((b - a for a, b in edges), default=0.0)
    start = walls[0] if walls else end_at
    return {
        "ok": bool(walls) and not over,
        "B_s": round(every, 1),
        "base_s": round(base, 1),
        "allowance_s": {k: round(v, 1) for k, v in allow.items()},
        "longest_gap_s": round(longest, 1),
        "closest_to_bound": worst,
        "over_bound": over[:5],
        "gaps_over_bound": len(over),
        "faults": [{"at": t, "after_first_step_s": round(t - start, 1), "fault": f,
                    "allowance_s": round(allow.get(f, 0.0), 1)} for t, f in sorted(faults)],
        "inputs": {"walls": walls, "faults": [[t, f] for t, f in sorted(faults)],
                   "end_at": end_at, "lease_ttl_s": lease_ttl_s, "startup_s": startup_s,
                   "corrupt_count": corrupt_count},
    }  # fmt: skip


def recheck(no_stall: dict) -> dict:
    """The check again from a finished soak's `no_stall` answer (its `inputs`), e.g. read
    back from the soak's JSON: with this module's allowances as they are now."""
    if "inputs" not in no_stall:
        raise ValueError("this no_stall answer predates its inputs: a soak written before "
                         "the check recorded them cannot be rechecked")  # fmt: skip
    i = no_stall["inputs"]
    faults = [(float(t), str(f)) for t, f in i["faults"]]
    walls = [float(w) for w in i["walls"]]
    return check(
        walls, faults, float(i["end_at"]), float(i["lease_ttl_s"]), float(i["startup_s"]),
        int(i["corrupt_count"]),
    )  # fmt: skip


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise SystemExit("usage: python -m bench.chaos_stall SOAK.json")
    with open(argv[0]) as f:
        r = json.load(f)
    again = recheck(r["soak"]["audit"]["checks"]["no_stall"])
    shown = {k: v for k, v in again.items() if k not in ("inputs", "faults")}
    print(json.dumps({**shown, "faults": again["faults"]}, indent=1))
    return 0 if again["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
