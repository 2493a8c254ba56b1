"""Cost-aware activation vs an all-active fleet, from one SFT warm start, plus the planner's
prediction of each arm checked against the arm itself.

    python -m bench.activation --out=/tmp/activation.json [--steps=80] \
        [--prices=0.40,0.30,0.15,0.10] [--throttle_s=0.6,0.6,0.0,0.0] \
        [--config=configs/tiny_arith.py] [--workdir=/tmp/echo2_bench_activation] \
        [--base=SFT_WORKDIR] [--summarize_only] [--set KEY=VALUE ...]

The local fleet is four workers, worker i at prices[i] and sleeping throttle_s[i] per lease.
The defaults make the two expensive workers slow and the two cheap ones fast: measured on the
shared 2-core box (BUILD_NOTES.md, "Capacity model"), the expensive pair makes ~70
rollouts/s each and the cheap pair 200-300 each, while the learner needs R / T = 256 / T
(~140/s at T ~ 1.8 s under load, ~510/s at T ~ 0.5 s on an idle box): the cheap pair, or
under load the cheapest worker alone, covers (1 + 10%) R / T and the expensive pair is
surplus. Two arms run `--steps` RL steps each from one SFT warm start
(`--base` reuses one already made, e.g. by an earlier run of this bench):
`all_active` (controller.activation=False) and `cost_aware` (True, re-solved every
`--activation_period_s`, 5 s here rather than the config's 30 s because an arm lasts about a
minute). Reported per arm: fleet cost per RL step (`cost/usd` delta / steps), learner
utilization, held-out accuracy, RL wall time, the activation's choices over time (changes of
fleet/active_workers and fleet/standby_workers by step, and the controller's log lines), and
bridge/plan/from_run.compare: the planner fed the arm's measured numbers, its predicted
utilization and cost per step beside the measured ones. Goal (issue 13): cost per step at
least 30% lower with utilization within 5 points and accuracy within 2 points.

The honest baseline (issue 30) is not "everyone active" but the cheapest FIXED set a careful
user would pick by hand: after the all-active arm, every non-empty subset of the workers is
planned (bridge/plan/planner.py, activation off, fed the all-active arm's measured speeds,
step time and swap delays) and the cheapest subset whose planned utilization is within
`_GOAL["utilization_points"]` of the planned all-active one is run as a third real arm,
`best_fixed` (only those workers, activation off). The verdict reports cost-aware against
both; `cost_reduction_vs_best_fixed` is the number that says what activation buys over a
user who sized the fleet by hand from the same measurements.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil

from bench import arms
from bridge.plan import fleet as fleet_lib
from bridge.plan import from_run, planner

_GOAL = {"cost_reduction": 0.30, "utilization_points": 5.0, "accuracy_points": 2.0}


def _floats(s: str) -> tuple[float, ...]:
    return tuple(float(x) for x in s.split(","))


def timeline(workdir: str, log: str) -> dict:
    """The activation's choices: (step, seconds into RL, active, standby) at each change,
    and the controller's 'activation:' log lines."""
    rows = from_run._rl_rows(workdir)
    t0, changes, last = rows[0]["time/wall"], [], None
    for r in rows:
        state = (r.get("fleet/active_workers"), r.get("fleet/standby_workers"))
        if state != last:
            changes.append([r["step"], round(r["time/wall"] - t0, 1), *state])
            last = state
    lines = []
    if os.path.exists(log):
        with open(log) as f:
            lines = [re.sub(r"^.*?activation:", "activation:", ln.strip()) for ln in f if
                     "activation:" in ln]  # fmt: skip
    return {"changes_step_s_active_standby": changes, "log": lines}


def best_fixed_set(workdir: str, prices: tuple[float, ...]) -> dict:
    """Plan every non-empty subset of the all-active arm's measured workers (activation
    off) and pick the cheapest per step whose planned utilization is within the goal's
    points of planning them all. Workers are matched to their index by price (distinct)."""
    raw = from_run.fleet_from_run(workdir)
    index = {w["price_per_hour"]: prices.index(w["price_per_hour"]) for w in raw["workers"]}
    plans = []
    for k in range(1, len(raw["workers"]) + 1):
        for subset in itertools.combinations(raw["workers"], k):
            plan = planner.plan(fleet_lib.parse(json.loads(json.dumps({**raw, "workers": subset}))))
            plans.append(
                {
                    "workers": sorted(index[w["price_per_hour"]] for w in subset),
                    "utilization": plan["predicted_utilization"],
                    "cost_per_step_usd": plan["cost_per_step_usd"],
                }
            )
    full = max(plans, key=lambda p: len(p["workers"]))
    floor = full["utilization"] - _GOAL["utilization_points"] / 100
    good = [p for p in plans if p["utilization"] >= floor]
    return {"chosen": min(good, key=lambda p: p["cost_per_step_usd"]), "plans": plans}


def _table(results: dict) -> str:
    cols = (  # (key, header, format): costs in micro-USD per step, they are tiny here
        ("cost_per_step_usd", "uUSD/step", lambda v: f"{1e6 * v:.1f}"),
        ("plan_cost_per_step_usd", "plan uUSD/step", lambda v: f"{1e6 * v:.1f}"),
        ("learner_utilization", "utilization", lambda v: f"{v:.3f}"),
        ("plan_utilization", "plan util", lambda v: f"{v:.3f}"),
        ("accuracy_before", "acc before", lambda v: f"{v:.3f}"),
        ("accuracy_after", "acc after", lambda v: f"{v:.3f}"),
        ("rl_wall_s", "RL wall s", lambda v: f"{v:.1f}"),
        ("step_s_median", "step s (med)", lambda v: f"{v:.2f}"),
        ("cost_usd", "cost USD", lambda v: f"{v:.4f}"),
    )
    lines = [f"{'arm':<12}" + "".join(f"{h:>16}" for _, h, _ in cols)]
    for name, r in results.items():
        lines.append(f"{name:<12}" + "".join(f"{fmt(r[k]):>16}" for k, _, fmt in cols))
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--prices", default="0.40,0.30,0.15,0.10")
    p.add_argument("--throttle_s", default="0.6,0.6,0.0,0.0")
    p.add_argument("--activation_period_s", type=float, default=5.0)
    p.add_argument("--config", default="configs/tiny_arith.py")
    p.add_argument("--workdir", default="/tmp/echo2_bench_activation")
    p.add_argument("--base", default="", help="an existing SFT warm start workdir to reuse")
    p.add_argument("--set", nargs="*", default=[], help="extra KEY=VALUE config overrides")
    p.add_argument(
        "--summarize_only",
        action="store_true",
        help="re-read the arms already in --workdir (no runs; process_wall_s is then 0)",
    )
    a = p.parse_args()

    prices, throttle = _floats(a.prices), _floats(a.throttle_s)
    if a.base or a.summarize_only:
        os.makedirs(a.workdir, exist_ok=True)
        base = a.base
    else:
        base = arms.warm_start(a.config, a.workdir, a.set)
    fleet = [
        f"total_steps={a.steps}",
        f"local_workers={len(prices)}",
        f"fleet.prices=({','.join(map(str, prices))})",
        f"fleet.throttle_s=({','.join(map(str, throttle))})",
        f"controller.activation_period_s={a.activation_period_s}",
        *a.set,
    ]
    results, checks, enumeration = {}, {}, None
    for name, on in (("all_active", False), ("best_fixed", False), ("cost_aware", True)):
        wd = os.path.join(a.workdir, name)
        overrides = [*fleet, f"controller.activation={on}"]
        if name == "best_fixed":
            enumeration = best_fixed_set(os.path.join(a.workdir, "all_active"), prices)
            keep = enumeration["chosen"]["workers"]
            sized = ("local_workers=", "fleet.prices=", "fleet.throttle_s=")
            overrides = [
                *(o for o in overrides if not o.startswith(sized)),
                f"local_workers={len(keep)}",
                f"fleet.prices=({','.join(str(prices[i]) for i in keep)},)",
                f"fleet.throttle_s=({','.join(str(throttle[i]) for i in keep)},)",
            ]
        if a.summarize_only:
            r = arms.arm_result(wd, 0.0)
        else:
            shutil.rmtree(wd, ignore_errors=True)  # a previous run of this bench
            r = arms.run_arm(a.config, base, a.workdir, name, overrides)
        cmp = from_run.compare(wd)
        m = cmp["measured"]
        r.update(
            cost_per_step_usd=m["cost_per_step_usd"],
            utilization_second_half=m["utilization_second_half"],
            step_s_median=m["step_s_median"],
            plan_utilization=cmp["plan"]["utilization"],
            plan_cost_per_step_usd=cmp["plan"]["cost_per_step_usd"],
            activation=timeline(wd, os.path.join(a.workdir, f"{name}.log")),
        )
        results[name], checks[name] = r, cmp

    print(_table(results))
    for name, r in results.items():
        print(f"{name} activation changes (step, s, active, standby):",
              r["activation"]["changes_step_s_active_standby"])  # fmt: skip
    aa, ca, bf = results["all_active"], results["cost_aware"], results["best_fixed"]
    verdict = {
        "cost_reduction": 1 - ca["cost_per_step_usd"] / aa["cost_per_step_usd"],
        "cost_reduction_vs_best_fixed": 1 - ca["cost_per_step_usd"] / bf["cost_per_step_usd"],
        "utilization_gap_points_vs_best_fixed": 100
        * (bf["learner_utilization"] - ca["learner_utilization"]),
        "best_fixed_workers": enumeration["chosen"]["workers"],
        "best_fixed_enumeration": enumeration["plans"],
        "utilization_gap_points": 100 * (aa["learner_utilization"] - ca["learner_utilization"]),
        "accuracy_gap_points": 100 * (aa["accuracy_after"] - ca["accuracy_after"]),
        "plan_error": {n: c["error"] for n, c in checks.items()},
        "plan_same_active_count": {n: c["same_active_count"] for n, c in checks.items()},
        "load_average_1_5_15": os.getloadavg(),
    }
    # Issue 13's validation target: the planner fed an arm's measured numbers predicts its
    # utilization and cost per step within 10% (steady state: the second half, once the
    # activation has settled and speeds are measured; the whole run is reported beside it).
    verdict["plan_within_10pct_second_half"] = {
        n: all(
            c["error"][k] is not None and abs(c["error"][k]) <= 0.10
            for k in ("utilization_second_half", "cost_per_step_second_half")
        )
        for n, c in checks.items()
    }
    eps = 1e-9  # 0.98 - 0.96 is 2.0000000000000018 points in floating point
    verdict["goal_met"] = (
        verdict["cost_reduction"] >= _GOAL["cost_reduction"]
        and abs(verdict["utilization_gap_points"]) <= _GOAL["utilization_points"] + eps
        and abs(verdict["accuracy_gap_points"]) <= _GOAL["accuracy_points"] + eps
    )
    results["planner_vs_measured"] = checks
    arms.save(results, verdict, {**vars(a), "overrides": fleet}, a.out)


if __name__ == "__main__":
    main()
