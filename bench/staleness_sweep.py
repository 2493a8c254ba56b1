"""How stale is too stale: quality and speed against S, per off-policy correction.

    python -m bench.staleness_sweep --out=F.json [--quick] [--tasks=demo,kuhn] \
        [--staleness=0,1,2,4,8] [--seeds=0,1,2] [--corrections=none,tis,token_mis] \
        [--steps_demo=30] [--steps_kuhn=40] [--sft_steps_demo=0] [--throttle_s=1.0] \
        [--png=F.png]

For each task (demo: configs/tiny_arith.py, held-out accuracy; kuhn: configs/kuhn_poker.py,
exact expected chips per hand) one SFT warm start runs once (bench/arms.py); every cell
(S, correction, seed) then runs RL from a copy of it with the real local fleet: two vLLM
workers, the second throttled by `--throttle_s` per lease (bench/slow_worker.py's
fleet), `controller.refuse_too_slow=False` so the slow worker's trajectories are used and
the staleness really reaches S, `loss.off_policy` = the correction (learner_jax/losses.py:
`none`, `tis` truncated IS, `token_mis` two-sided masked IS, IcePop).

Per cell: final quality (the run's last evaluation), wall time from the first RL step to
the first evaluation at or above the target (--target_demo, --target_kuhn; None if never),
mean learner utilization, mean and max staleness, mean mismatch/kl. The table is the mean
over seeds (and the per-seed values in the JSON); the PNG plots quality against wall time,
one panel per (task, correction), one colour per S.

`--sft_steps_demo` shortens the demo's warm start (0 = the config's own 2000 SFT steps,
~3 minutes on a quiet 2-core machine, once per sweep).

`--quick`: S in {0, 4}, seed 0, corrections none and tis, 10 RL steps per task and 100 demo
SFT steps: a smoke run of the whole pipeline, not a measurement.

Cost: every cell is a full `learner_jax.train` process (worker start ~28 s, vLLM warm-up,
JAX compile) plus its steps, so the full grid (2 tasks x 5 S x 3 corrections x 3 seeds =
90 cells) is shortened by steps per cell, never by cells. Estimated on a quiet 2-core
machine from the demo's measured numbers (BUILD_NOTES.md: worker start ~28 s, ~0.6 s per
demo step): ~60 s per demo cell and ~100 s per Kuhn cell, ~2 hours in all; the fixed cost
per process, not the steps, is what exceeds the issue's 60 minutes (a sweep that keeps
the workers and the compiled step across cells would fit; not built).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from bench import arms

TASKS = {  # name: (config, eval key, default target)
    "demo": ("configs/tiny_arith.py", "accuracy", 0.5),
    "kuhn": ("configs/kuhn_poker.py", "expected_reward", 0.0),
}


def cell_result(workdir: str, key: str, target: float, process_s: float) -> dict:
    """One run's numbers from its metrics.jsonl and eval.jsonl."""
    from learner_jax import report
    from learner_jax.metrics import read_jsonl

    rows = report.rl_rows(workdir)
    evals = [e for e in read_jsonl(os.path.join(workdir, "eval.jsonl")) if key in e]
    t0 = rows[0]["time/wall"] - rows[0].get("time/step_s", 0.0) if rows else 0.0
    hit = next((e for e in evals if e["tag"] != "before" and e[key] >= target), None)
    mean = lambda k: statistics.fmean(r[k] for r in rows if k in r) if rows else None
    return {
        "steps": len(rows),
        "process_wall_s": process_s,
        "rl_wall_s": rows[-1]["time/wall"] - t0 if rows else None,
        "quality_before": evals[0][key] if evals else None,
        "quality_final": evals[-1][key] if evals else None,
        "time_to_target_s": None if hit is None else hit["time"] - t0,
        "learner_utilization": mean("learner/utilization"),
        "staleness_mean": mean("staleness/mean"),
        "staleness_max": max((r.get("staleness/max", 0) for r in rows), default=None),
        "mismatch_kl": mean("mismatch/kl"),
        "curve": [(e["time"] - t0, e[key]) for e in evals],
    }


def summarize(cells: list[dict]) -> list[dict]:
    """Mean over seeds of each (task, S, correction)."""
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        groups.setdefault((c["task"], c["S"], c["correction"]), []).append(c)
    out = []
    for (task, s, corr), cs in sorted(groups.items()):
        row = {"task": task, "S": s, "correction": corr, "seeds": len(cs)}
        for k in ("quality_final", "learner_utilization", "staleness_mean", "mismatch_kl"):
            vals = [c[k] for c in cs if c[k] is not None]
            row[k] = statistics.fmean(vals) if vals else None
        row["quality_final_sd"] = (
            statistics.stdev(c["quality_final"] for c in cs) if len(cs) > 1 else 0.0
        )
        row["staleness_max"] = max(c["staleness_max"] or 0 for c in cs)
        times = [c["time_to_target_s"] for c in cs]
        reached = [t for t in times if t is not None]
        row["reached_target"] = f"{len(reached)}/{len(cs)}"
        row["time_to_target_s"] = statistics.median(reached) if reached else None
        out.append(row)
    return out


def print_table(rows: list[dict]) -> None:
    cols = ("quality_final", "quality_final_sd", "time_to_target_s", "reached_target",
            "learner_utilization", "staleness_mean", "staleness_max", "mismatch_kl")  # fmt: skip
    print(f"{'task':<6}{'S':>3} {'correction':<10}" + "".join(f"{c[:18]:>19}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r[c]
            cells.append(f"{v:>19.4f}" if isinstance(v, float) else f"{str(v):>19}")
        print(f"{r['task']:<6}{r['S']:>3} {r['correction']:<10}" + "".join(cells))


def plot(cells: list[dict], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(c["task"], c["correction"]) for c in cells})
    stales = sorted({c["S"] for c in cells})
    colours = {s: plt.cm.viridis(i / max(len(stales) - 1, 1)) for i, s in enumerate(stales)}
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (task, corr) in zip(axes[0], panels, strict=True):
        for c in cells:
            if (c["task"], c["correction"]) != (task, corr) or not c["curve"]:
                continue
            xs, ys = zip(*c["curve"], strict=True)
            first = c["seed"] == min(x["seed"] for x in cells)
            ax.plot(
                xs, ys, "o-", ms=2, color=colours[c["S"]], label=f"S={c['S']}" if first else None
            )
        ax.set_title(f"{task}, {corr}", fontsize=10)
        ax.set_xlabel("wall time since first RL step (s)", fontsize=8)
        ax.set_ylabel(TASKS[task][1], fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--png", default="")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tasks", default="demo,kuhn")
    p.add_argument("--staleness", default="0,1,2,4,8")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--corrections", default="none,tis,token_mis")
    p.add_argument("--steps_demo", type=int, default=30)
    p.add_argument("--steps_kuhn", type=int, default=40)
    p.add_argument("--target_demo", type=float, default=TASKS["demo"][2])
    p.add_argument("--target_kuhn", type=float, default=TASKS["kuhn"][2])
    p.add_argument("--sft_steps_demo", type=int, default=0)
    p.add_argument("--throttle_s", type=float, default=1.0)
    p.add_argument("--workdir", default="/tmp/echo2_staleness_sweep")
    p.add_argument("--set", nargs="*", default=[], help="extra KEY=VALUE config overrides")
    a = p.parse_args()
    if a.quick:
        a.staleness, a.seeds, a.corrections = "0,4", "0", "none,tis"
        a.steps_demo = a.steps_kuhn = 10
        a.sft_steps_demo = 100
    png = a.png or os.path.splitext(a.out)[0] + ".png"
    stales = [int(s) for s in a.staleness.split(",")]
    seeds = [int(s) for s in a.seeds.split(",")]
    corrections = a.corrections.split(",")
    cells = []
    for task in a.tasks.split(","):
        config, key, _ = TASKS[task]
        steps, target = getattr(a, f"steps_{task}"), getattr(a, f"target_{task}")
        # the arms repeat it, or they would resume the SFT phase up to the config's own count
        sft = [f"sft.steps={a.sft_steps_demo}"] if task == "demo" and a.sft_steps_demo else []
        base = arms.warm_start(config, os.path.join(a.workdir, task), [*sft, *a.set])
        for s in stales:
            for corr in corrections:
                for seed in seeds:
                    name = f"S{s}_{corr}_seed{seed}"
                    overrides = [
                        f"total_steps={steps}", f"staleness={s}", "publish_every=1",
                        "local_workers=2", f"fleet.throttle_s=(0.0,{a.throttle_s})",
                        "controller.refuse_too_slow=False", f"loss.off_policy={corr}",
                        f"seed={seed}", *sft, *a.set,
                    ]  # fmt: skip
                    wd = os.path.join(a.workdir, task, name)
                    arm = arms.run_arm(config, base, os.path.join(a.workdir, task), name, overrides)
                    cell = cell_result(wd, key, target, arm["process_wall_s"])
                    cells.append({"task": task, "S": s, "correction": corr, "seed": seed, **cell})
                    print(
                        f"  {task} {name}: final {cell['quality_final']}, "
                        f"{cell['process_wall_s']:.0f} s",
                        flush=True,
                    )
    rows = summarize(cells)
    print_table(rows)
    plot(cells, png)
    with open(a.out, "w") as f:
        json.dump({"table": rows, "cells": cells, "args": vars(a)}, f, indent=1)
    print(f"wrote {a.out} and {png}")


if __name__ == "__main__":
    main()
