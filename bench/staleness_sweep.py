"""How stale is too stale: quality and speed against S, per off-policy correction.

    python -m bench.staleness_sweep --out=F.json [--png=F.png] [--quick] [--tasks=kuhn,demo] \
        [--staleness=0,1,2,4,8] [--seeds=0,1,2] [--corrections=none,tis,token_mis] \
        [--steps_demo=12] [--steps_kuhn=24] [--throttle_s=1.0] [--set KEY=VALUE ...]

For each task (demo: configs/tiny_arith.py, greedy held-out accuracy; kuhn:
configs/kuhn_poker.py with its recipe pinned (KUHN_RECIPE), exact expected chips per hand)
one SFT warm start runs once (bench/arms.py, seed 0); every cell (S, correction, seed) then
runs RL from a copy of it with the real fleet: two vLLM workers, the second throttled by
`--throttle_s` per lease, `controller.refuse_too_slow=False` so the slow worker's
trajectories are used and the staleness really reaches S, `loss.off_policy` = the
correction (learner_jax/training/losses.py: `none`, `tis` truncated IS, `token_mis` two-sided
masked IS, IcePop), `seed` = the cell's seed (learner, prompt order; the SFT is shared).

How the grid fits (bench/sweep_cells.py): all cells of a task run in this one process,
each as the training binary's own `run()` (its controller, staleness rule, leases,
publisher, evaluations), fed by one standing pool of two workers that rejoin every cell's
controller at a fixed address (`controller.tell_run_over=False`), with JAX's persistent
compilation cache. Before the cells, one warm-up run per correction (the cells' exact
config, stopped after 2 steps) starts the pool and fills the cache, so no cell's RL time
holds a compile or a worker start. Runs are shortened, not the grid: `--steps_*` RL steps
per cell (12 demo, 24 Kuhn) with a short warmup (3 / 10 steps) and no lr decay
(`optimizer.end_lr_fraction=1`: a short run learns at the rate a long one starts with);
the demo at lr 3e-4 (its config's 1e-4 needs ~120 steps); evaluations every 3 / 4 steps.
The whole bench took 34 min on a quiet 2-core box (BUILD_NOTES.md, stop 37).

Per cell: final quality (the run's last evaluation), wall time from the first RL step to
the first evaluation at or above the target (--target_demo, --target_kuhn; None if never),
mean learner utilization, mean and max staleness, mean mismatch/kl, the cell's wall time
(process_wall_s: setup + RL + final evaluation). The table is the mean over seeds (per-seed
values in the JSON); the PNG plots quality against wall time, one panel per (task,
correction), one colour per S.

The JSON: `rows`, one per cell, in the benches' shared form (task, S, seed, correction,
quality = the final evaluation, wall_s = RL wall time, the PNG's x axis); `table`, the
means over seeds; `cells`, every number of every cell.

`--quick`: S in {0, 4}, seed 0, corrections none and tis, 10 RL steps, 100 demo SFT steps:
a smoke run of the whole pipeline, not a measurement. `--warm_start_TASK=DIR` reuses an
existing SFT workdir of the same config instead of running one (trials).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time

from bench import arms

TASKS = {  # name: (config, eval key, default target)
    "demo": ("configs/tiny_arith.py", "accuracy", 0.5),
    "kuhn": ("configs/kuhn_poker.py", "expected_reward", -0.15),
}


def cell_result(workdir: str, key: str, target: float, process_s: float) -> dict:
    """One run's numbers from its metrics.jsonl and eval.jsonl."""
    from learner_jax.reporting import report
    from learner_jax.reporting.metrics import read_jsonl

    rows = report.rl_rows(workdir)
    evals = [e for e in read_jsonl(os.path.join(workdir, "eval.jsonl")) if key in e]
    t0 = rows[0]["time/wall"] - rows[0].get("time/step_s", 0.0) if rows else 0.0
    hit = next((e for e in evals if e["tag"] != "before" and e[key] >= target), None)

    def mean(metric: str) -> float | None:  # None where no row has it (a run before the metric)
        values = [r[metric] for r in rows if metric in r]
        return statistics.fmean(values) if values else None

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
        # The off-policy gap S lets in: KL(behaviour || learner) over every trained token.
        "staleness_kl": mean("staleness/kl"),
        "curve": [(e["time"] - t0, e[key]) for e in evals],
    }


def rows_of(cells: list[dict]) -> list[dict]:
    """The JSON's `rows`: per cell, the keys every bench's rows share (module docstring)."""
    return [
        {
            "task": c["task"],
            "S": c["S"],
            "seed": c["seed"],
            "correction": c["correction"],
            "quality": c["quality_final"],
            "wall_s": c["rl_wall_s"],
        }
        for c in cells
    ]


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


def markdown(rows: list[dict]) -> str:
    """The table as markdown (README / BUILD_NOTES)."""
    head = ("| task | S | correction | final quality (mean ± sd) | reached target | "
            "time to target (median s) | learner utilization | staleness mean / max | "
            "mismatch/kl |")  # fmt: skip
    lines = [head, "|" + "---|" * 9]
    f = lambda v, spec: "-" if v is None else format(v, spec)
    for r in rows:
        lines.append(
            f"| {r['task']} | {r['S']} | {r['correction']} | "
            f"{r['quality_final']:+.3f} ± {r['quality_final_sd']:.3f} | {r['reached_target']} | "
            f"{f(r['time_to_target_s'], '.0f')} | {f(r['learner_utilization'], '.2f')} | "
            f"{f(r['staleness_mean'], '.2f')} / {r['staleness_max']} | "
            f"{f(r['mismatch_kl'], '.1e')} |"
        )
    return "\n".join(lines)


def plot(cells: list[dict], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({c["task"] for c in cells}, key=list(TASKS).index)
    corrs = list(dict.fromkeys(c["correction"] for c in cells))
    stales = sorted({c["S"] for c in cells})
    colours = {s: plt.cm.viridis(i / max(len(stales) - 1, 1)) for i, s in enumerate(stales)}
    fig, axes = plt.subplots(
        len(tasks),
        len(corrs),
        figsize=(4.2 * len(corrs), 3.4 * len(tasks)),
        squeeze=False,
        sharey="row",
    )  # one row per task, one column per correction
    for ax, (task, corr) in zip(axes.flat, [(t, c) for t in tasks for c in corrs], strict=True):
        for c in cells:
            if (c["task"], c["correction"]) != (task, corr) or not c["curve"]:
                continue
            xs, ys = zip(*c["curve"], strict=True)
            first = c["seed"] == min(x["seed"] for x in cells)
            ax.plot(
                xs, ys, "o-", ms=2, lw=1, color=colours[c["S"]],
                label=f"S={c['S']}" if first else None,
            )  # fmt: skip
        ax.set_title(f"{task}, {corr}", fontsize=10)
        ax.set_xlabel("wall time since first RL step (s)", fontsize=8)
        ax.set_ylabel(TASKS[task][1], fontsize=8)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


KUHN_RECIPE = [  # F0's recipe (BUILD_NOTES.md), pinned: later config edits must not move the sweep
    "advantages.name=dr_grpo", "optimizer.learning_rate=5e-4",
    "sft.steps=100", "sft.batch_size=64", "sft.micro_batch_size=64",
    "loss.kl_coef=0.0",  # the sweep's table was measured without the config's KL anchor
]  # fmt: skip


def cell_overrides(a, task: str, s: int, corr: str, seed: int) -> list[str]:
    return [
        f"total_steps={getattr(a, f'steps_{task}')}", f"staleness={s}", "publish_every=1",
        "controller.refuse_too_slow=False", f"loss.off_policy={corr}", f"seed={seed}",
        f"rollout.eval_period={getattr(a, f'eval_period_{task}')}",
        f"optimizer.warmup_steps={getattr(a, f'warmup_{task}')}",
        *([f"optimizer.learning_rate={a.lr_demo}"] if task == "demo" else []),
        # a short run learns at the rate a long one starts with: no decay (says the notes)
        "optimizer.end_lr_fraction=1.0",
    ]  # fmt: skip


def run_task(a, task: str, stales, corrections, seeds, on_cell) -> list[dict]:
    """Every cell of one task in this process, fed by one standing pool (sweep_cells.py)."""
    from bench import sweep_cells

    config_file, key, _ = TASKS[task]
    target = getattr(a, f"target_{task}")
    root = os.path.join(a.workdir, task)
    pinned = KUHN_RECIPE if task == "kuhn" else []
    # the arms repeat it, or they would resume the SFT phase up to the config's own count
    sft = [f"sft.steps={a.sft_steps_demo}"] if task == "demo" and a.sft_steps_demo else []
    given = getattr(a, f"warm_start_{task}")
    if given:  # an existing SFT workdir of the same config (trials; the sweep runs its own)
        shutil.rmtree(root, ignore_errors=True)
        base = os.path.join(root, "sft")
        shutil.copytree(given, base)
    else:
        base = arms.warm_start(config_file, root, [*pinned, *sft, *a.set])
    t0 = time.monotonic()
    first = sweep_cells.load(config_file, [*pinned, *sft, *a.set])
    pool = sweep_cells.Pool(first, os.path.join(root, "pool"), a.throttle_s)
    fixed = [*pinned, *sft, *pool.overrides(), *a.set]
    cells = []
    try:
        # Warm-up (not cells): the pool's workers start, and one run per correction with
        # the cells' exact config, stopped after 2 steps, compiles what the cells then load.
        for corr in corrections:
            wd = os.path.join(root, f"warmup_{corr}")
            sweep_cells.copy_warm_start(base, wd)
            config = sweep_cells.load(config_file, [*fixed, *cell_overrides(a, task, 2, corr, 0)])
            secs = sweep_cells.run_cell(config, wd, pool, stop_after=2)
            print(f"{task}: warm-up {corr} {secs:.0f} s", flush=True)
        print(f"{task}: pool up and warm after {time.monotonic() - t0:.0f} s", flush=True)
        for seed in seeds:  # seed outermost: a cut-short sweep still has every (S, correction)
            for s in stales:
                for corr in corrections:
                    name = f"S{s}_{corr}_seed{seed}"
                    wd = os.path.join(root, name)
                    sweep_cells.copy_warm_start(base, wd)
                    config = sweep_cells.load(
                        config_file, [*fixed, *cell_overrides(a, task, s, corr, seed)]
                    )
                    secs = sweep_cells.run_cell(config, wd, pool)
                    cell = cell_result(wd, key, target, secs)
                    cells.append({"task": task, "S": s, "correction": corr, "seed": seed, **cell})
                    on_cell(cells[-1])
                    print(
                        f"  {task} {name}: {cell['quality_before']} -> {cell['quality_final']}, "
                        f"cell {secs:.1f} s, RL {cell['rl_wall_s']:.1f} s, "
                        f"staleness {cell['staleness_mean']:.2f}/{cell['staleness_max']}, "
                        f"util {cell['learner_utilization']:.2f} (load {os.getloadavg()[0]:.1f})",
                        flush=True,
                    )
    finally:
        pool.close()
    return cells


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--png", default="")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tasks", default="kuhn,demo")
    p.add_argument("--staleness", default="0,1,2,4,8")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--corrections", default="none,tis,token_mis")
    p.add_argument("--steps_demo", type=int, default=12)
    p.add_argument("--steps_kuhn", type=int, default=24)
    p.add_argument("--eval_period_demo", type=int, default=3)
    p.add_argument("--eval_period_kuhn", type=int, default=4)
    p.add_argument("--warmup_demo", type=int, default=3)
    p.add_argument("--warmup_kuhn", type=int, default=10)  # the binary's cold-Adam threshold
    p.add_argument("--lr_demo", type=float, default=3e-4)
    p.add_argument("--target_demo", type=float, default=TASKS["demo"][2])
    p.add_argument("--target_kuhn", type=float, default=TASKS["kuhn"][2])
    p.add_argument("--sft_steps_demo", type=int, default=0)
    p.add_argument("--warm_start_demo", default="", help="reuse this SFT workdir (trials)")
    p.add_argument("--warm_start_kuhn", default="", help="reuse this SFT workdir (trials)")
    p.add_argument("--throttle_s", type=float, default=1.0)
    p.add_argument("--workdir", default="/tmp/echo2_staleness_sweep")
    p.add_argument("--compile_cache", default="", help="default: WORKDIR/jax_cache")
    p.add_argument("--set", nargs="*", default=[], help="extra KEY=VALUE config overrides")
    p.add_argument("--render", default="", help="table, markdown and PNG of a saved JSON")
    a = p.parse_args()
    if a.render:  # a finished sweep's F.json, or a cut-short one's F.json.partial
        with open(a.render) as f:
            cells = json.load(f)["cells"]
        rows = summarize(cells)
        print_table(rows)
        print(markdown(rows))
        plot(cells, a.png or os.path.splitext(a.out)[0] + ".png")
        return
    if a.quick:
        a.staleness, a.seeds, a.corrections = "0,4", "0", "none,tis"
        a.steps_demo = a.steps_kuhn = 10
        a.warmup_demo = a.warmup_kuhn = 3
        a.sft_steps_demo = 100
    from bench import sweep_cells

    sweep_cells.enable_compile_cache(a.compile_cache or os.path.join(a.workdir, "jax_cache"))
    png = a.png or os.path.splitext(a.out)[0] + ".png"
    stales = [int(s) for s in a.staleness.split(",")]
    seeds = [int(s) for s in a.seeds.split(",")]
    corrections = a.corrections.split(",")
    t0 = time.monotonic()
    cells = []

    def save_partial(cell: dict) -> None:  # a sweep cut short keeps the cells it finished
        cells.append(cell)
        with open(a.out + ".partial", "w") as f:
            partial = {"rows": rows_of(cells), "cells": cells, "args": vars(a)}
            json.dump({**partial, "wall_s": time.monotonic() - t0}, f)

    for task in a.tasks.split(","):
        run_task(a, task, stales, corrections, seeds, save_partial)
    rows = summarize(cells)
    print_table(rows)
    print(markdown(rows))
    plot(cells, png)
    wall = time.monotonic() - t0
    with open(a.out, "w") as f:
        out = {"rows": rows_of(cells), "table": rows, "cells": cells, "args": vars(a)}
        json.dump({**out, "wall_s": wall}, f, indent=1)
    print(f"wrote {a.out} and {png} after {wall:.0f} s (load {os.getloadavg()})")


if __name__ == "__main__":
    main()
