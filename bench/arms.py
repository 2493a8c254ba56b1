"""Shared harness for benchmarks that compare RL runs ("arms") from one SFT warm start.

One SFT warm start runs once (`--config.total_steps=0`); each arm gets a copy of that
workdir (without the SFT metrics) and runs `python -m learner_jax.train` with its own
overrides, so arms differ only in what the overrides change (same seed, same workers).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def train(config: str, workdir: str, overrides: list[str], log: str) -> float:
    """Run the training binary to completion; returns its wall time."""
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


def warm_start(config: str, workdir: str, overrides: list[str]) -> str:
    """A fresh `workdir` holding one SFT warm start; returns its path."""
    shutil.rmtree(workdir, ignore_errors=True)
    os.makedirs(workdir)
    base = os.path.join(workdir, "sft")
    print(f"SFT warm start -> {base}", flush=True)
    train(config, base, ["total_steps=0", *overrides], os.path.join(workdir, "sft.log"))
    return base


def run_arm(config: str, base: str, workdir: str, name: str, overrides: list[str]) -> dict:
    """Copy the warm start to `workdir/name`, run the arm, summarize it (`arm_result`)."""
    wd = os.path.join(workdir, name)
    shutil.copytree(base, wd)
    for stale in ("metrics.jsonl", "eval.jsonl", "tb"):  # SFT lines stay with the base
        path = os.path.join(wd, stale)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    print(f"{name}: {' '.join(overrides)}", flush=True)
    secs = train(config, wd, overrides, os.path.join(workdir, f"{name}.log"))
    return arm_result(wd, secs)


def arm_result(workdir: str, process_s: float) -> dict:
    from learner_jax.evaluation.evals import EVAL_FILE
    from learner_jax.reporting import report
    from learner_jax.reporting.metrics import read_jsonl

    rows = report.rl_rows(workdir)
    evals = {e["tag"]: e["accuracy"] for e in read_jsonl(os.path.join(workdir, EVAL_FILE))}
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
        "groups_dropped": rows[-1]["staleness/dropped"],
        "groups_accepted": rows[-1]["groups/accepted"],
    }


def print_table(results: dict, cols: tuple[str, ...]) -> None:
    print(f"{'arm':<16}" + "".join(f"{c:>22}" for c in cols))
    for name, r in results.items():
        print(f"{name:<16}" + "".join(f"{r[c]:>22.4f}" for c in cols))


def save(results: dict, verdict: dict, config: dict, out: str) -> None:
    """Write the arms, the verdict and the config as JSON; print the verdict."""
    results.update(verdict=verdict, config=config)
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(verdict), f"\nwrote {out}")
