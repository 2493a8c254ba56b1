"""Asynchronous (S=2) vs synchronous (S=0) GRPO on the same local fleet, in one invocation.

    python bench/async_vs_sync.py --out=/tmp/async_vs_sync.json [--steps=60] \
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
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(config: str, workdir: str, overrides: list[str], log: str) -> float:
    cmd = [
        sys.executable,
        "-m",
        "learner_jax.train",
        f"--config={config}",
        f"--workdir={workdir}",
        *[f"--config.{kv}" for kv in overrides],
    ]
    t0 = time.monotonic()
    with open(log, "w") as f:
        subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=True)
    return time.monotonic() - t0


def arm_result(workdir: str, process_s: float) -> dict:
    from learner_jax import report

    rows = report.rl_rows(workdir)
    evals = {}
    with open(os.path.join(workdir, "eval.jsonl")) as f:
        for line in f:
            e = json.loads(line)
            evals[e["tag"]] = e["accuracy"]
    walls = [r["time/wall"] for r in rows]
    return {
        "steps": len(rows),
        "rl_wall_s": walls[-1] - walls[0],
        "process_wall_s": process_s,
        "learner_utilization": statistics.fmean(r["learner/utilization"] for r in rows),
        "staleness_mean": statistics.fmean(r["staleness/mean"] for r in rows),
        "wait_s_mean": statistics.fmean(r["time/wait_s"] for r in rows),
        "accuracy_before": evals.get("before"),
        "accuracy_after": evals.get("after"),
        "reward_last10": statistics.fmean(r["reward/mean"] for r in rows[-10:]),
        "cost_usd": rows[-1]["cost/usd"],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--config", default="configs/tiny_arith.py")
    p.add_argument("--workdir", default="/tmp/echo2_bench")
    p.add_argument("--set", nargs="*", default=[], help="extra KEY=VALUE config overrides")
    a = p.parse_args()
    sys.path.insert(0, ROOT)

    shutil.rmtree(a.workdir, ignore_errors=True)
    base = os.path.join(a.workdir, "sft")
    os.makedirs(a.workdir)
    print(f"SFT warm start -> {base}", flush=True)
    train(a.config, base, ["total_steps=0", *a.set], os.path.join(a.workdir, "sft.log"))

    results = {}
    for name, s in (("sync_S0", 0), ("async_S2", 2)):
        wd = os.path.join(a.workdir, name)
        shutil.copytree(base, wd)
        for stale in ("metrics.jsonl", "eval.jsonl", "tb"):  # SFT lines stay with the base
            path = os.path.join(wd, stale)
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.exists(path):
                os.remove(path)
        print(f"{name}: {a.steps} RL steps with staleness={s}", flush=True)
        overrides = [f"total_steps={a.steps}", f"staleness={s}", "publish_every=1", *a.set]
        secs = train(a.config, wd, overrides, os.path.join(a.workdir, f"{name}.log"))
        results[name] = arm_result(wd, secs)

    cols = ("rl_wall_s", "learner_utilization", "staleness_mean", "accuracy_before",
            "accuracy_after", "cost_usd")  # fmt: skip
    print(f"{'arm':<10}" + "".join(f"{c:>22}" for c in cols))
    for name, r in results.items():
        print(f"{name:<10}" + "".join(f"{r[c]:>22.4f}" for c in cols))
    s0, s2 = results["sync_S0"], results["async_S2"]
    results["verdict"] = {
        "wall_time_ratio_S0_over_S2": s0["rl_wall_s"] / s2["rl_wall_s"],
        "utilization_ratio_S2_over_S0": s2["learner_utilization"] / s0["learner_utilization"],
        "async_faster": s2["rl_wall_s"] < s0["rl_wall_s"],
        "async_higher_utilization": s2["learner_utilization"] > s0["learner_utilization"],
        "accuracy_gap_points": 100 * (s0["accuracy_after"] - s2["accuracy_after"]),
    }
    results["config"] = {"config": a.config, "steps": a.steps, "overrides": a.set}
    with open(a.out, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results["verdict"]), f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
