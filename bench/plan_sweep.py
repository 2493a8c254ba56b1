"""Sweep the fleet planner over the staleness bound S and link bandwidth; settle kappa = S - 1.

    python -m bench.plan_sweep --out=/tmp/plan_sweep/sweep.json \
        [--fleet=configs/fleets/qwen3_8b.json] [--steps=150] [--bw_scales=0.5,1,2,4]

Part 1: for each bandwidth scale (every worker's bandwidth and the learner uplink times the
scale) and S = 1..8 (kappa from the fleet file), `bridge.plan` on the fleet: simulated and
analytic utilization, capacity.py's min S, drops, cost, and the ECHO-2 / centralized cost
ratio. Printed as a table, plotted into plan_sweep.png next to --out.

Part 2: the question PAPER.md raises. With kappa = S - 1, capacity.py says the learner
stays busy iff latency <= T (ours) whatever S; PAPER.md's derivation says <= 2 T. A small
synthetic fleet with exactly the required throughput (margin 0) and with 25% to spare is
simulated for latency / T from 0.5 to 2.5 and S = 2, 3, 5; the table shows where the
simulated learner starts to stall (utilization and dropped rollouts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

from bridge.control.fleet import capacity
from bridge.plan import fleet as fleet_lib
from bridge.plan import planner, simulate

RATIOS = (0.5, 0.8, 0.9, 1.0, 1.1, 1.2, 1.5, 1.8, 2.0, 2.2, 2.5)


def sweep_s(fleet, scales, s_values):
    rows = []
    for scale in scales:
        for s in s_values:
            f = planner.with_overrides(
                fleet,
                staleness=s,
                learner_uplink_mb_s=fleet.learner.uplink_mb_s * scale,
                workers=tuple(
                    dataclasses.replace(w, bandwidth_mb_s=w.bandwidth_mb_s * scale)
                    for w in fleet.workers
                ),
            )
            p = planner.plan(f)
            rows.append(
                {
                    "bw_scale": scale,
                    "staleness": s,
                    "min_staleness": p["min_staleness"],
                    "latency_s": p["latency_s"],
                    "sim_utilization": p["predicted_utilization"],
                    "analytic_utilization": p["analytic_utilization"],
                    "dropped_rollouts": p["dropped_rollouts"],
                    "wall_h": p["wall_s"] / 3600,
                    "cost_usd": p["cost_usd"],
                    "cost_per_step_usd": p["cost_per_step_usd"],
                    "cost_ratio": p["cost_ratio"],
                    "baseline_cost_usd": p["baseline"]["cost_usd"],
                    "active": p["active"],
                }
            )
    return rows


def freshness_fleet(latency_over_t: float, s: int, margin_workers: int) -> fleet_lib.Fleet:
    """T = 10 s, R = 64, leases of 1 rollout taking 2.5 s, broadcast 0.5 s; publish_s fills
    the rest of the latency. 16 workers at 0.4 rollouts/s make exactly R / T."""
    latency = latency_over_t * 10.0
    return fleet_lib.parse(
        {
            "learner": {
                "step_s": 10.0,
                "rollouts_per_step": 64,
                "publish_s": latency - 3.0,
                "price_per_hour": 1.0,
            },
            "model_bytes": 5e7,
            "staleness": s,
            "publish_every": s - 1,
            "steps": 120,
            "margin": 0.0,
            "group_size": 1,
            "broadcast": "store",
            "workers": [
                {
                    "name": "w",
                    "count": 16 + margin_workers,
                    "price_per_hour": 0.1,
                    "rollouts_per_s": 0.4,
                    "bandwidth_mb_s": 100.0,
                }
            ],
        }
    )


def sweep_freshness():
    rows = []
    for extra, label in ((0, "exact"), (4, "+25%")):
        for s in (2, 3, 5):
            for r in RATIOS:
                f = freshness_fleet(r, s, extra)
                # Activation would drop the spare workers; simulate them all on purpose.
                specs = planner.worker_specs(f, {"w": f.workers[0].count})
                lat, _ = planner.latency_s(f, specs)
                sim = simulate.simulate(planner.sim_config(f), specs)
                cap = capacity.report(
                    sum(s_.rollouts_per_s for s_ in specs), 64, 10.0, s, s - 1, lat
                )
                rows.append(
                    {
                        "fleet": label,
                        "staleness": s,
                        "publish_every": s - 1,
                        "latency_over_t": lat / 10.0,
                        "sim_utilization": sim["steady_utilization"],
                        "dropped_rollouts": sim["dropped_rollouts"],
                        "analytic_utilization": cap.predicted_utilization,
                        "capacity_fresh_ok": cap.fresh_ok,
                        "paper_fresh_ok": lat <= 2 * 10.0 + 1e-9,
                    }
                )
    return rows


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for scale in sorted({r["bw_scale"] for r in rows}):
        rs = [r for r in rows if r["bw_scale"] == scale]
        xs = [r["staleness"] for r in rs]
        a1.plot(xs, [r["cost_usd"] for r in rs], "o-", label=f"bandwidth x{scale}")
        a2.plot(xs, [r["sim_utilization"] for r in rs], "o-", label=f"sim, bw x{scale}")
        a2.plot(xs, [r["analytic_utilization"] for r in rs], "k:", alpha=0.4)
    base = rows[0]["baseline_cost_usd"]
    if base:
        a1.axhline(base, color="r", ls="--", label="centralized baseline")
    a1.set(xlabel="staleness S", ylabel="run cost (USD)", title="cost vs S")
    a2.set(
        xlabel="staleness S", ylabel="learner utilization", title="utilization (dotted: analytic)"
    )
    a1.legend(fontsize=8)
    a2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--fleet", default="configs/fleets/qwen3_8b.json")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--bw_scales", default="0.5,1,2,4")
    args = p.parse_args()
    t0 = time.time()
    fleet = planner.with_overrides(fleet_lib.load(args.fleet), steps=args.steps)
    scales = [float(x) for x in args.bw_scales.split(",")]
    rows = sweep_s(fleet, scales, range(1, 9))
    print(f"Part 1: {args.fleet}, kappa={fleet.publish_every}, broadcast={fleet.broadcast}")
    print(" bw   S  minS  lat_s  util_sim  util_an  dropped  wall_h  cost_usd  ratio")
    for r in rows:
        print(
            f"{r['bw_scale']:4.1f} {r['staleness']:2d} {r['min_staleness']:4d} "
            f"{r['latency_s']:6.0f} {r['sim_utilization']:9.3f} {r['analytic_utilization']:8.3f} "
            f"{r['dropped_rollouts']:8d} {r['wall_h']:7.2f} {r['cost_usd']:9.1f} "
            f"{r['cost_ratio']:6.3f}"
        )
    fresh = sweep_freshness()
    print("\nPart 2: kappa = S - 1; simulated utilization (dropped rollouts) vs latency / T")
    print("fleet  S  " + " ".join(f"{x:>11.2f}" for x in RATIOS))
    for label in ("exact", "+25%"):
        for s in (2, 3, 5):
            rs = [r for r in fresh if r["fleet"] == label and r["staleness"] == s]
            cells = " ".join(f"{r['sim_utilization']:5.3f}({r['dropped_rollouts']:4d})" for r in rs)
            print(f"{label:5s} {s:2d}  {cells}")
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    png = os.path.join(out_dir, "plan_sweep.png")
    plot(rows, png)
    with open(args.out, "w") as f:
        json.dump({"sweep": rows, "freshness_kappa_s_minus_1": fresh, "plot": png}, f, indent=1)
    print(f"wrote {args.out} and {png} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
