"""Asynchronous (S=2) vs synchronous (S=0) GRPO on the same local fleet, in one invocation.

    python -m bench.async_vs_sync --out=/tmp/async_vs_sync.json [--steps=60] \
        [--config=configs/tiny_arith.py] [--workdir=/tmp/echo2_bench] [--set KEY=VALUE ...]

One SFT warm start is run once (`--config.total_steps=0`) and its workdir copied, so both
arms start from the same checkpoint; then each arm runs `python -m learner_jax.train`
for `--steps` RL steps with `--config.staleness=S` (and `publish_every=1`), same workers,
same seed. S=0 is "generate, then train": step t+1 only consumes trajectories sampled
by version t, so the learner idles while the fleet generates and vice versa.

Reported per arm: wall time of the RL steps (first to last metrics line), mean learner
utilization, mean staleness, held-out accuracy before and after; printed as a table and
written as JSON.
"""

from __future__ import annotations

import argparse

from bench import arms


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--config", default="configs/tiny_arith.py")
    p.add_argument("--workdir", default="/tmp/echo2_bench")
    p.add_argument("--set", nargs="*", default=[], help="extra KEY=VALUE config overrides")
    a = p.parse_args()

    base = arms.warm_start(a.config, a.workdir, a.set)
    results = {}
    for name, s in (("sync_S0", 0), ("async_S2", 2)):
        overrides = [f"total_steps={a.steps}", f"staleness={s}", "publish_every=1", *a.set]
        results[name] = arms.run_arm(a.config, base, a.workdir, name, overrides)

    arms.print_table(
        results,
        ("rl_wall_s", "learner_utilization", "staleness_mean", "accuracy_before",
         "accuracy_after", "cost_usd"),
    )  # fmt: skip
    s0, s2 = results["sync_S0"], results["async_S2"]
    verdict = {
        "wall_time_ratio_S0_over_S2": s0["rl_wall_s"] / s2["rl_wall_s"],
        "utilization_ratio_S2_over_S0": s2["learner_utilization"] / s0["learner_utilization"],
        "async_faster": s2["rl_wall_s"] < s0["rl_wall_s"],
        "async_higher_utilization": s2["learner_utilization"] > s0["learner_utilization"],
        "accuracy_gap_points": 100 * (s0["accuracy_after"] - s2["accuracy_after"]),
    }
    arms.save(results, verdict, {"config": a.config, "steps": a.steps, "overrides": a.set}, a.out)


if __name__ == "__main__":
    main()
