"""Async RL without bias: partial rollouts against the staleness bound's drops, and
staleness="auto" against the best fixed S.

    python -m bench.async_bias --out=F.json [--parts=bias,auto] \
        [--bias_task=reversal] [--bias_staleness=1] [--bias_steps=12] [--bias_throttle_s=auto] \
        [--bias_throttle_steps=2] [--news_baseline] \
        [--auto_task=demo|kuhn] [--fixed=0,1,2,4] [--auto_min=0] [--auto_max=4] [--auto_no_kl] \
        [--auto_steps=12|24] [--auto_throttle_s=1] [--auto_throttle_fast_s=0] \
        [--warm_start_TASK=DIR] [--warm_start_auto=DIR] \
        [--workdir=/tmp/echo2_async_bias] [--set KEY=VALUE ...] [--combine=A.json,B.json]

Headline: `dropped_frac_off`, `dropped_frac_continue` (dropped / (dropped + consumed)
groups), `length_bias_off`, `length_bias_continue` (mean completion length of the dropped
groups over the consumed ones; None when nothing was dropped: no drop, no bias),
`auto_quality_minus_best_fixed`, `auto_util_minus_best_fixed`.

Part `bias` (the machinery of bench/staleness_bias.py): from one SFT warm start of a task
whose answer lengths vary (reversal: reasoning-gym word_sequence_reversal, answers of 19-77
tokens), two runs of the training binary at one S, fed by the same two real vLLM workers, the
second sleeping `--bias_throttle_s` per lease (`auto`, the default: `--bias_throttle_steps`
(2) times the learner's step period measured on this machine now, `learner_step_s`):
`rollout.partial=off` with the too-slow rule off (`controller.refuse_too_slow=False`: the
slow worker's late leases are dropped, the bias item 1 measured) and
`rollout.partial=continue` (the worker swaps in the newest version before it generates and
whenever one is ready while it generates, continuing its unfinished samples under it; the
controller judges a group by its newest token, bridge/contracts/staleness.py). Each run's
controller database says what was consumed and dropped; for `continue` also how many
consumed groups carry tokens of several versions, and the token lag (the mean over the
consumed tokens of the consuming step minus the version that sampled the token). With
`--news_baseline` a third run, `continue_unheld`, has `controller.news_hold=False`: its
worker hears of a version mid-lease only at its next heartbeat, not when it is published
(bridge/control/http/version_news.py); `token_lag_continue` against
`token_lag_continue_unheld` is what the held heartbeats buy.

Why the throttle follows the learner: with S = 1 a group of version v may be consumed by
steps v and v + 1, so a lease must come back within about two learner step periods. A fixed
throttle measures nothing on a box where the step is longer than it (reversal at 10 s
dropped nothing when its steps took 25-45 s) and drops every slow lease where the step is
much shorter; about twice the period puts the slow worker's leases near the deadline (at
2 every reversal slow lease came back late with `off`, at 1.5 most: docs/results.md). The
period is measured by a short
calibration run of the same cell (`CALIBRATION_STEPS` RL steps, both workers unthrottled;
it also fills the compile cache): per step, the wall time since the previous step less the
time the learner waited for data, the median over the steps after the first two (the
first compiles).

Part `auto` (the cells of bench/staleness_sweep.py, reduced) for `--auto_task`: the demo from
the sweep's SFT warm start (the config's own 2000 steps), or Kuhn poker from the sweep's
pinned recipe (`KUHN_RECIPE`: 100 SFT steps); one run per fixed S in `--fixed` and one with
`staleness="auto"` in [`--auto_min`, `--auto_max`] (with `--auto_no_kl` a second, `auto_nokl`,
without the KL ceiling: `staleness_kl_max=0`), one seed, correction `tis`, the sweep's fleet
(second worker throttled `--auto_throttle_s`, the first `--auto_throttle_fast_s`, default 0)
and schedule (`--auto_steps` RL steps, 12 demo / 24 Kuhn, the demo at lr 3e-4, evaluations
every 3 / 4 steps, the too-slow rule off). The best fixed S is the one with the highest final
quality (the demo's held-out accuracy, Kuhn's exact expected chips per hand), ties to the
higher learner utilization; the headline is auto's quality and mean utilization minus that
S's. One seed per run (`--seed`): the sweep's seed-to-seed sd of the final quality was
0.03-0.09 for the demo, 0.004-0.03 for Kuhn (docs/results.md), the noise a difference must
beat. """

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import time
from types import SimpleNamespace

from bench import staleness_bias


def _warm_start(a, config_file: str, pinned: list[str], given: str, root: str) -> str:
    """An SFT warm start in `root/sft`: a copy of `given`, else a fresh one (in this process,
    so every override is read as the cells read theirs)."""
    from bench import sweep_cells
    from learner_jax import train

    base = os.path.join(root, "sft")
    shutil.rmtree(root, ignore_errors=True)
    if given:
        shutil.copytree(given, base)
    else:
        print(f"SFT warm start -> {base}", flush=True)
        train.run(sweep_cells.load(config_file, ["total_steps=0", *pinned, *a.set]), base)
    return base


def continued_groups(db_path: str) -> tuple[int, int, float | None]:
    """(consumed groups with tokens of more than one version, consumed groups, token lag):
    the token lag is the mean over the consumed completion tokens of the consuming step
    minus the version that sampled the token, how far behind the learner the policy that
    drew a trained token was."""
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        rows = conn.execute(
            "SELECT payload, consumed_step FROM groups WHERE state='consumed'"
        ).fetchall()
    finally:
        conn.close()
    mixed, lags = 0, []
    for payload, step in rows:
        trajs = json.loads(payload) if payload else []
        mixed += len({v for t in trajs for v in t["versions"]}) > 1
        lags += [step - v for t in trajs for v in t["versions"]]
    return mixed, len(rows), (statistics.fmean(lags) if lags else None)


CALIBRATION_STEPS = 5  # RL steps of the calibration run; the first compiles


def learner_step_s(rows: list[dict]) -> float:
    """The learner's step period without waiting for data: per RL metrics row after the
    first two (the first compiles, the second's wall time includes the first's), the wall
    time since the previous row less `time/wait_s`; the median."""
    periods = [
        r["time/wall"] - prev["time/wall"] - r.get("time/wait_s", 0.0)
        for prev, r in zip(rows[1:], rows[2:], strict=False)  # each row with the one before
    ]
    if not periods:
        raise ValueError(f"{len(rows)} RL steps: need at least 3 to measure the learner's step")
    return statistics.median(periods)


def calibrate_throttle(a, config_file: str, pinned: list[str], base: str, root: str) -> float:
    """`learner_step_s` of a short run of the bias cell (`off`) with both workers
    unthrottled, on this machine at its load now."""
    from bench import sweep_cells
    from learner_jax.reporting import report

    first = sweep_cells.load(config_file, [*pinned, *a.set])
    pool = sweep_cells.Pool(first, os.path.join(root, "pool"), 0.0)
    wd = os.path.join(root, "calibration")
    try:
        sweep_cells.copy_warm_start(base, wd)
        overrides = [*pinned, *pool.overrides(), *a.set, *_bias_run(a), "rollout.partial=off"]
        cfg = sweep_cells.load(config_file, overrides)
        sweep_cells.run_cell(cfg, wd, pool, stop_after=CALIBRATION_STEPS)
    finally:
        pool.close()
    return learner_step_s(report.rl_rows(wd))


def _bias_run(a) -> list[str]:
    knobs = SimpleNamespace(steps=a.bias_steps, refuse_too_slow=False, seed=a.seed)
    return staleness_bias.cell_overrides(knobs, a.bias_staleness)


def _bias_arms(a) -> list[tuple[str, str, list[str]]]:
    """(arm, rollout.partial, overrides): `off`, `continue`, and with `--news_baseline`
    `continue` without held heartbeats (the worker hears of versions mid-lease only at its
    heartbeat interval: bridge/control/http/version_news.py)."""
    arms = [("off", "off", []), ("continue", "continue", [])]
    if a.news_baseline:
        arms.append(("continue_unheld", "continue", ["controller.news_hold=False"]))
    return arms


def run_bias(a, cells: list[dict], on_cell) -> None:
    """The `bias` part's cells, appended to `cells` as each finishes (then `on_cell()`)."""
    from bench import sweep_cells

    task, s = a.bias_task, a.bias_staleness
    config_file, pinned = staleness_bias.TASKS[task]
    root = os.path.join(a.workdir, "bias")
    base = _warm_start(a, config_file, pinned, getattr(a, f"warm_start_{task}"), root)
    step_s = None
    throttle_s = a.bias_throttle_s
    if throttle_s == "auto":
        step_s = calibrate_throttle(a, config_file, pinned, base, root)
        throttle_s = a.bias_throttle_steps * step_s
        print(f"  learner step {step_s:.1f} s -> throttle {throttle_s:.1f} s", flush=True)
    first = sweep_cells.load(config_file, [*pinned, *a.set])
    pool = sweep_cells.Pool(first, os.path.join(root, "pool"), throttle_s)
    try:
        for arm, partial, arm_set in _bias_arms(a):
            wd = os.path.join(root, arm)
            sweep_cells.copy_warm_start(base, wd)
            run = [*_bias_run(a), *arm_set]
            overrides = [*pinned, *pool.overrides(), *a.set, *run, f"rollout.partial={partial}"]
            secs = sweep_cells.run_cell(sweep_cells.load(config_file, overrides), wd, pool)
            cell = staleness_bias.cell_of(wd, task, s, secs)
            cell["partial"] = arm
            cell["throttle_s"], cell["learner_step_s"] = throttle_s, step_s
            db = os.path.join(wd, "controller.db")
            cell["continued_groups"], _, cell["token_lag"] = continued_groups(db)
            cells.append(cell)
            on_cell()
            print(f"  {task} S={s} partial={arm}: {secs:.0f} s, {cell['headline']}, "
                  f"continued groups {cell['continued_groups']}, token lag "
                  f"{cell['token_lag']}", flush=True)  # fmt: skip
    finally:
        pool.close()


# The staleness sweep's schedule per task (bench/staleness_sweep.py's defaults): evaluations
# every N RL steps, warmup steps (Kuhn's 10: the binary's cold-Adam threshold), RL steps.
AUTO_SCHEDULE = {"demo": (3, 3), "kuhn": (4, 10)}
DEFAULT_AUTO_STEPS = {"demo": 12, "kuhn": 24}


def run_auto(a, cells: list[dict], on_cell) -> None:
    """The `auto` part's cells, appended to `cells` as each finishes (then `on_cell()`)."""
    from bench import staleness_sweep, sweep_cells

    task = a.auto_task
    # The sweep's task as the sweep runs it: the demo with its config's own SFT (2000 steps,
    # after which RL moves held-out accuracy from ~0.07 to ~0.8 in 12 steps), Kuhn poker with
    # the sweep's pinned recipe (100 SFT steps, then RL towards the game's value -1/18).
    config_file, key, target = staleness_sweep.TASKS[task]
    pinned = staleness_sweep.KUHN_RECIPE if task == "kuhn" else []
    root = os.path.join(a.workdir, "auto")
    base = _warm_start(a, config_file, pinned, a.warm_start_auto, root)
    first = sweep_cells.load(config_file, [*pinned, *a.set])
    pool = sweep_cells.Pool(
        first, os.path.join(root, "pool"), a.auto_throttle_s, fast_throttle_s=a.auto_throttle_fast_s
    )
    eval_period, warmup = AUTO_SCHEDULE[task]
    knobs = SimpleNamespace(**{f"steps_{task}": a.auto_steps or DEFAULT_AUTO_STEPS[task],
                               f"eval_period_{task}": eval_period, f"warmup_{task}": warmup,
                               "lr_demo": 3e-4})  # fmt: skip
    fixed = [*pinned, *pool.overrides(), *a.set]
    try:
        for s in [*a.fixed, "auto", *(["auto_nokl"] if a.auto_no_kl else [])]:
            wd = os.path.join(root, f"S{s}")
            sweep_cells.copy_warm_start(base, wd)
            auto = isinstance(s, str)
            overrides = [*fixed, *staleness_sweep.cell_overrides(
                knobs, task, "auto" if auto else s, "tis", a.seed)]  # fmt: skip
            if auto:
                overrides += [f"staleness_min={a.auto_min}", f"staleness_max={a.auto_max}"]
            if s == "auto_nokl":  # the same rule without its KL ceiling
                overrides += ["staleness_kl_max=0"]
            secs = sweep_cells.run_cell(sweep_cells.load(config_file, overrides), wd, pool)
            cell = {"task": task, "S": s, **staleness_sweep.cell_result(wd, key, target, secs)}
            if auto:
                cell["bound_path"] = _bounds(wd)
            cells.append(cell)
            on_cell()
            print(f"  {task} S={s}: quality {cell['quality_before']} -> {cell['quality_final']},"
                  f" util {cell['learner_utilization']:.2f}, {secs:.0f} s", flush=True)  # fmt: skip
    finally:
        pool.close()


def _bounds(workdir: str) -> list[int]:
    """staleness/bound per RL step of an auto run."""
    from learner_jax.reporting import report

    return [int(r["staleness/bound"]) for r in report.rl_rows(workdir) if "staleness/bound" in r]


def headline_of(bias: list[dict], auto: list[dict]) -> dict:
    by = {c["partial"]: c["headline"] for c in bias}
    off, on = by.get("off", {}), by.get("continue", {})
    out = {
        "dropped_frac_off": off.get("dropped_frac"),
        "dropped_frac_continue": on.get("dropped_frac"),
        "length_bias_off": off.get("length_bias"),
        "length_bias_continue": on.get("length_bias"),
    }
    for c in bias:
        if c["partial"] != "off":  # the held heartbeats' effect: continue vs continue_unheld
            out[f"token_lag_{c['partial']}"] = c.get("token_lag")
    per_task = {}
    for task in dict.fromkeys(c["task"] for c in auto):
        fixed = [c for c in auto if c["task"] == task and isinstance(c["S"], int)]
        fixed = [c for c in fixed if c["quality_final"] is not None]
        auto_cells = [c for c in auto if c["task"] == task and c["S"] == "auto"]
        if not (fixed and auto_cells):
            continue
        best = max(fixed, key=lambda c: (c["quality_final"], c["learner_utilization"] or 0.0))
        (mine,) = auto_cells
        per_task[task] = (
            best["S"],
            mine["quality_final"] - best["quality_final"],
            mine["learner_utilization"] - best["learner_utilization"],
        )
    for task, (s, dq, du) in per_task.items():
        out[f"best_fixed_S_{task}"] = s
        out[f"auto_quality_minus_best_fixed_{task}"] = dq
        out[f"auto_util_minus_best_fixed_{task}"] = du
    if per_task:  # over several tasks (--combine), the worst task's: auto must hold on each
        out["auto_quality_minus_best_fixed"] = min(dq for _, dq, _ in per_task.values())
        out["auto_util_minus_best_fixed"] = min(du for _, _, du in per_task.values())
    return out


def rows_of(bias: list[dict], auto: list[dict]) -> list[dict]:
    rows = []
    for c in bias:
        d, k = c["dropped"], c["consumed"]
        rows.append({
            "part": "bias", "task": c["task"], "S": c["S"], "partial": c["partial"],
            "consumed": k["groups"], "dropped": d["groups"], "continued": c["continued_groups"],
            "token_lag": c.get("token_lag"),
            "length_consumed": k["length"], "length_dropped": d["length"],
            "reward_consumed": k["reward"], "reward_dropped": d["reward"],
            "slow_share_consumed": k["slow_share"], "starved_prompts": c["starved_prompts"],
            "max_drops_per_prompt": c["max_drops_per_prompt"], "wall_s": c["wall_s"],
            "throttle_s": c.get("throttle_s"), "learner_step_s": c.get("learner_step_s"),
            **{f"headline_{x}": v for x, v in c["headline"].items()},
        })  # fmt: skip
    for c in auto:
        rows.append({
            "part": "auto", "task": c["task"], "S": c["S"], "quality": c["quality_final"],
            "quality_before": c["quality_before"], "utilization": c["learner_utilization"],
            "staleness_mean": c["staleness_mean"], "staleness_max": c["staleness_max"],
            "staleness_kl": c.get("staleness_kl"),
            "wall_s": c["rl_wall_s"], "bound_path": c.get("bound_path"),
        })  # fmt: skip
    return rows


def markdown(rows: list[dict]) -> str:
    f = lambda v, spec=".3f": "-" if v is None else format(v, spec)
    lines = [
        "| task | S | partial | consumed / dropped groups | continued groups | token lag | "
        "dropped frac | mean length consumed / dropped | length bias | slow worker's consumed "
        "share | starved prompts |",
        "|" + "---|" * 11,
    ]
    for r in (r for r in rows if r["part"] == "bias"):
        lines.append(
            f"| {r['task']} | {r['S']} | {r['partial']} | {r['consumed']} / {r['dropped']} | "
            f"{r['continued']} | {f(r.get('token_lag'), '.2f')} | "
            f"{f(r['headline_dropped_frac'])} | "
            f"{f(r['length_consumed'], '.2f')} / {f(r['length_dropped'], '.2f')} | "
            f"{f(r['headline_length_bias'])} | {f(r['slow_share_consumed'], '.2f')} | "
            f"{r['starved_prompts']} |"
        )
    lines += ["", "| task | S | final quality (from) | learner utilization | staleness mean / max "
              "| staleness KL | RL wall s | S over the run |", "|" + "---|" * 8]  # fmt: skip
    for r in (r for r in rows if r["part"] == "auto"):
        path = r["bound_path"]
        lines.append(
            f"| {r['task']} | {r['S']} | {f(r['quality'])} ({f(r['quality_before'])}) | "
            f"{f(r['utilization'], '.2f')} | {f(r['staleness_mean'], '.2f')} / "
            f"{r['staleness_max']} | {f(r.get('staleness_kl'), '.2e')} | {f(r['wall_s'], '.0f')} | "
            f"{'-' if not path else ' '.join(map(str, path))} |"
        )
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--parts", default="bias,auto")
    p.add_argument("--bias_task", default="reversal", choices=sorted(staleness_bias.TASKS))
    p.add_argument("--bias_staleness", type=int, default=1)
    p.add_argument("--bias_steps", type=int, default=12)
    p.add_argument(
        "--bias_throttle_s",
        default="auto",
        type=lambda v: v if v == "auto" else float(v),  # a typo fails here, not after the SFT
        help="seconds the slow worker sleeps per lease; auto: --bias_throttle_steps steps",
    )
    p.add_argument(
        "--bias_throttle_steps",
        type=float,
        default=2.0,
        help="auto throttle: this many learner step periods, measured (docstring)",
    )
    p.add_argument(
        "--news_baseline",
        action="store_true",
        help="also run continue without held heartbeats (controller.news_hold=False)",
    )
    p.add_argument("--auto_task", default="demo", choices=sorted(AUTO_SCHEDULE))
    p.add_argument("--fixed", default="0,1,2,4")
    p.add_argument("--auto_min", type=int, default=0)
    p.add_argument(
        "--auto_no_kl", action="store_true",
        help="auto: a second auto cell without the KL ceiling (staleness_kl_max=0)",
    )  # fmt: skip
    p.add_argument("--auto_max", type=int, default=4)
    p.add_argument(
        "--auto_steps", type=int, default=0, help="RL steps per cell; 0: 12 demo, 24 Kuhn"
    )
    p.add_argument("--auto_throttle_s", type=float, default=1.0)
    p.add_argument(
        "--auto_throttle_fast_s", type=float, default=0.0,
        help="auto: the first worker's throttle too (a fleet whose latency needs a larger S)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    for task in staleness_bias.TASKS:
        p.add_argument(f"--warm_start_{task}", default="", help="bias: reuse this SFT workdir")
    p.add_argument("--warm_start_auto", default="", help="auto: reuse this SFT workdir")
    p.add_argument("--workdir", default="/tmp/echo2_async_bias")
    p.add_argument("--set", nargs="*", default=[], help="extra KEY=VALUE config overrides")
    p.add_argument(
        "--combine", default="", help="no runs: A.json,B.json (parts run apart) -> --out"
    )
    a = p.parse_args()
    a.fixed = [int(s) for s in a.fixed.split(",") if s]
    if a.combine:
        parts = [json.load(open(f)) for f in a.combine.split(",")]
        bias = [c for d in parts for c in d["bias_cells"]]
        auto = [c for d in parts for c in d["auto_cells"]]
        with open(a.out, "w") as f:
            out = {"headline": headline_of(bias, auto), "rows": rows_of(bias, auto),
                   "bias_cells": bias, "auto_cells": auto, "args": vars(a)}  # fmt: skip
            json.dump(out, f, indent=1)
        print(markdown(out["rows"]))
        print(json.dumps(out["headline"], indent=1))
        return
    from bench import sweep_cells

    sweep_cells.enable_compile_cache(os.path.join(a.workdir, "jax_cache"))
    t0 = time.monotonic()
    bias: list[dict] = []
    auto: list[dict] = []

    def save() -> None:  # after every cell: a run cut short keeps what it finished
        rows = rows_of(bias, auto)
        out = {"headline": headline_of(bias, auto), "rows": rows, "bias_cells": bias,
               "auto_cells": auto, "args": vars(a), "wall_s": time.monotonic() - t0}  # fmt: skip
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)

    parts = a.parts.split(",")
    if "bias" in parts:
        run_bias(a, bias, save)
    if "auto" in parts:
        run_auto(a, auto, save)
    save()
    print(markdown(rows_of(bias, auto)))
    print(json.dumps(headline_of(bias, auto), indent=1))
    print(f"wrote {a.out} after {time.monotonic() - t0:.0f} s (load {os.getloadavg()})")


if __name__ == "__main__":
    main()
