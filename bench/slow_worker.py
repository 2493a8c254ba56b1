"""A worker too slow for the staleness bound: refused (freshness-aware leasing) vs leased.

    python -m bench.slow_worker --out=/tmp/slow_worker.json [--steps=120] \
        [--throttle_s=3.0] [--config=configs/tiny_arith.py] [--workdir=/tmp/echo2_bench_slow] \
        [--set KEY=VALUE ...]

The local fleet is a fast worker and one that sleeps `--throttle_s` per lease (default 3 s,
longer than S = 2 learner steps). From one SFT warm start, two arms run `--steps` RL steps:
`refuse` (controller.refuse_too_slow=True, the default:
bridge/control/leasing/lease_timing.py) and `lease` (False: the slow worker gets leases like
any other). Reported per arm: RL wall time, learner utilization, groups dropped as stale out
of those accepted, held-out accuracy and fleet cost; a table and JSON.
"""

from __future__ import annotations

import argparse

from bench import arms


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--throttle_s", type=float, default=3.0)
    p.add_argument("--config", default="configs/tiny_arith.py")
    p.add_argument("--workdir", default="/tmp/echo2_bench_slow")
    p.add_argument("--set", nargs="*", default=[], help="extra KEY=VALUE config overrides")
    a = p.parse_args()

    base = arms.warm_start(a.config, a.workdir, a.set)
    fleet = [f"total_steps={a.steps}", f"fleet.throttle_s=(0.0,{a.throttle_s})", *a.set]
    results = {
        name: arms.run_arm(
            a.config, base, a.workdir, name, [*fleet, f"controller.refuse_too_slow={refuse}"]
        )
        for name, refuse in (("refuse", True), ("lease", False))
    }
    arms.print_table(
        results,
        ("rl_wall_s", "learner_utilization", "groups_dropped", "groups_accepted",
         "accuracy_after", "cost_usd"),
    )  # fmt: skip
    on, off = results["refuse"], results["lease"]
    verdict = {
        "wall_time_ratio_lease_over_refuse": off["rl_wall_s"] / on["rl_wall_s"],
        "dropped_fraction_refuse": on["groups_dropped"] / on["groups_accepted"],
        "dropped_fraction_lease": off["groups_dropped"] / off["groups_accepted"],
        "accuracy_gap_points": 100 * (on["accuracy_after"] - off["accuracy_after"]),
    }
    arms.save(results, verdict, vars(a), a.out)


if __name__ == "__main__":
    main()
