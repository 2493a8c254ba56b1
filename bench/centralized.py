"""The planner's centralized baseline, calibrated from a measured colocated run (issue 30).

    python -m bench.centralized --out=/tmp/centralized.json [--steps=30] \
        [--learner_price=2.0] [--config=configs/tiny_arith.py] [--workdir=/tmp/echo2_centralized]
        [--base=SFT_WORKDIR]

`bridge.plan` compares ECHO-2 with a centralized synchronous baseline: the learner alone,
each step generating R rollouts at `learner.rollouts_per_s` and then training. The fleet
files carry that speed as an estimate (configs/fleets/qwen3_8b.json: 6 rollouts/s, and
plan_sweep's cost ratio of 0.55 rests on it; 0.71 at 10/s). Here it is measured instead, on
the machine at hand, with the same model and task, in two real arms from one SFT warm start:

- `colocated`: the learner and one vLLM engine on the same machine, generation and training
  in turn (staleness 0, one local worker priced 0: it stands for the learner's own
  accelerator, which the baseline bills as the learner's).
- `echo2`: the config's distributed fleet (its local workers and prices, S from the config).

Calibration: generation seconds per step in the colocated arm = its mean wall per step minus
its mean train step (the learner trains, then waits while the engine generates), so
`learner.rollouts_per_s` = R / that. The planner is then fed the echo2 arm's measured fleet
(bridge/plan/from_run.py) with the calibrated baseline speed and `--learner_price`, and the
ratio ECHO-2 / centralized is reported both ways: as the planner predicts it and as the two
runs measured it (wall per step and cost per step: learner price x wall + the fleet's bill).
On this CPU box both arms share the same cores, so the measured ratio says how well the
planner's baseline is calibrated, not what a GPU fleet would save.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

from bench import arms
from bridge.plan import fleet as fleet_lib
from bridge.plan import from_run, planner


def calibrated_rollouts_per_s(colocated_wd: str) -> float:
    """R / (wall per step - train step) of a generate-then-train run."""
    with open(os.path.join(colocated_wd, "config.json")) as f:
        batch = json.load(f)["batch"]
    m = from_run.measured(colocated_wd)
    gen_s = m["wall_per_step_s"] - m["step_s_mean"]
    if gen_s <= 0:
        raise ValueError(f"{colocated_wd}: no generation time left per step ({gen_s:.3f} s)")
    return batch["groups_per_step"] * batch["samples_per_group"] / gen_s


def compare(colocated_wd: str, echo2_wd: str, learner_price: float) -> dict:
    rate = calibrated_rollouts_per_s(colocated_wd)
    raw = from_run.fleet_from_run(echo2_wd)
    raw["learner"] = {**raw["learner"], "rollouts_per_s": rate, "price_per_hour": learner_price}
    plan = planner.plan(fleet_lib.parse(json.loads(json.dumps(raw))))
    steps = raw["steps"]
    col, echo = from_run.measured(colocated_wd), from_run.measured(echo2_wd)

    def per_step_cost(m: dict) -> float:
        return learner_price * m["wall_per_step_s"] / 3600.0 + m["cost_per_step_usd"]

    predicted = {
        "echo2_wall_per_step_s": plan["wall_s"] / steps,
        "centralized_wall_per_step_s": plan["baseline"]["step_s"],
        "echo2_cost_per_step_usd": plan["cost_usd"] / steps,
        "centralized_cost_per_step_usd": plan["baseline"]["cost_usd"] / steps,
    }
    measured = {
        "echo2_wall_per_step_s": echo["wall_per_step_s"],
        "centralized_wall_per_step_s": col["wall_per_step_s"],
        "echo2_cost_per_step_usd": per_step_cost(echo),
        "centralized_cost_per_step_usd": per_step_cost(col),
    }
    for d in (predicted, measured):
        d["wall_ratio"] = d["echo2_wall_per_step_s"] / d["centralized_wall_per_step_s"]
        d["cost_ratio"] = d["echo2_cost_per_step_usd"] / d["centralized_cost_per_step_usd"]
    return {
        "calibrated_learner_rollouts_per_s": rate,
        "colocated_train_step_s": col["step_s_mean"],
        "predicted": predicted,
        "measured": measured,
        "error": {
            k: (predicted[k] - measured[k]) / measured[k] for k in ("wall_ratio", "cost_ratio")
        },
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--learner_price", type=float, default=2.0, help="USD per hour")
    p.add_argument("--config", default="configs/tiny_arith.py")
    p.add_argument("--workdir", default="/tmp/echo2_centralized")
    p.add_argument("--base", default="", help="an existing SFT warm start workdir to reuse")
    p.add_argument("--set", nargs="*", default=[], help="extra KEY=VALUE config overrides")
    a = p.parse_args()

    if a.base:
        os.makedirs(a.workdir, exist_ok=True)
        for arm in ("colocated", "echo2"):
            shutil.rmtree(os.path.join(a.workdir, arm), ignore_errors=True)
    base = a.base or arms.warm_start(a.config, a.workdir, a.set)
    common = [f"total_steps={a.steps}", "publish_every=1", *a.set]
    colocated = [
        *common,
        "staleness=0",
        "local_workers=1",
        "fleet.prices=(0.0,)",
        "fleet.throttle_s=(0.0,)",
        "controller.activation=False",
    ]
    results = {
        "colocated": arms.run_arm(a.config, base, a.workdir, "colocated", colocated),
        "echo2": arms.run_arm(a.config, base, a.workdir, "echo2", common),
    }
    arms.print_table(results, ("rl_wall_s", "learner_utilization", "accuracy_after"))
    cmp = compare(*(os.path.join(a.workdir, n) for n in ("colocated", "echo2")), a.learner_price)
    print(f"calibrated learner rollouts/s: {cmp['calibrated_learner_rollouts_per_s']:.1f}")
    print(f"{'':<10}{'wall ratio':>12}{'cost ratio':>12}   (ECHO-2 / centralized, per step)")
    for side in ("predicted", "measured"):
        print(f"{side:<10}{cmp[side]['wall_ratio']:>12.3f}{cmp[side]['cost_ratio']:>12.3f}")
    arms.save(results, cmp, vars(a), a.out)


if __name__ == "__main__":
    main()
