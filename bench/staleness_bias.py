"""Which groups does the staleness bound throw away? Consumed vs dropped vs never leased, per S.

    python -m bench.staleness_bias --out=F.json [--tasks=demo,kuhn,reversal] \
        [--staleness=0,1,2,4] [--steps=20] [--throttle_s=3.0] [--refuse_too_slow] \
        [--warm_start_TASK=DIR] [--workdir=/tmp/echo2_staleness_bias] [--set KEY=VALUE ...]

Dropping late work is how a staleness bound is enforced, and it can bias training: if long
answers (often the hard prompts) come back late more often, they are dropped more often
and the learner trains on a length- and difficulty-skewed sample. This bench measures it
on the real pipeline: for each task one short SFT warm start, then one RL run per S -- the
training binary's own `run()` with its controller, staleness rule, leases and publisher,
fed by two real vLLM workers, the second sleeping `--throttle_s` per lease
(bench/sweep_cells.py, as the staleness sweep runs its cells). By default the too-slow rule
is off (`controller.refuse_too_slow=False`, the sweep's setting): with it on little is
dropped, and a bound that drops nothing cannot bias; `--refuse_too_slow` measures the default
instead. The throttle (3 s) must outlast the learner's step for anything to come back late:
the reversal task's longer steps need ~10 s.

Tasks: `demo` (configs/tiny_arith.py: 2-digit + and -, answers of 1-3 digits), `kuhn`
(configs/kuhn_poker.py with the sweep's pinned recipe: episodes of one or two decisions) and
`reversal` (reasoning-gym's word_sequence_reversal, lists of 1-6 words: answers of 2 to ~60
characters, 19-77 tokens with the tags, so generation time varies several-fold by prompt;
a smaller batch than its config's, or a step takes ~13 s on 2 loaded cores).

Where the numbers come from: each run's controller database (`<cell>/controller.db`).
`consumed` groups are the rows the learner took (the run checkpoints only at its end, so no
consumed trajectory is forgotten before it is read; the bench checks the row count against
the controller's `groups/consumed` counter); `dropped` are the controller's record of every
group the staleness bound requeued (table `dropped`: prompt, step, stalest version, worker,
each completion's token count and reward); `never leased` are prompts drawn into the queue
that no worker leased by the end of the run (their completions do not exist; only the
prompt and the reference answer can be compared). A dropped prompt is requeued, so it may
be consumed later: `retried` pairs each dropped attempt with the same prompt's consumed one.

Per (task, S), per category: groups, mean completion length in tokens (the mean over the
group's samples, then over groups), mean reward, mean reference answer length in characters,
and the share made by the throttled worker; the headline, keyed `TASK_S{S}_NAME`, is `length_bias` =
mean length dropped / consumed (1.0 = no bias; None with nothing dropped), the same with each
dropped prompt counted once (`length_bias_by_prompt`) and against the throttled worker's own
consumed groups (`length_bias_same_worker`: every drop is that worker's, so this holds the
worker fixed), `reward_gap` = mean
reward dropped - consumed, `dropped_frac` = dropped / (dropped + consumed), and for never
leased prompts `answer_len_ratio_never_leased` = their mean reference answer length / the
consumed ones'. A standard error of each mean over groups is in the JSON, so a ratio from a
handful of dropped groups reads as what it is. Per prompt: how many distinct prompts the
drops were, the most drops of one, and `starved_prompts`, those dropped and never consumed by
the end (a requeued group goes back to the front of the queue, so the worker that returned it
late can lease it again at once).

`--reread`: no runs; rebuild --out from the runs already in --workdir (their databases).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sqlite3
import statistics
import time

TASKS = {  # name: (config file, pinned overrides)
    "demo": ("configs/tiny_arith.py", ["sft.steps=300"]),
    "kuhn": (
        "configs/kuhn_poker.py",
        ["advantages.name=dr_grpo", "optimizer.learning_rate=5e-4", "loss.kl_coef=0.0"],
    ),
    "reversal": (
        "configs/reasoning_gym_spell_backward.py",
        [
            "task.dataset=word_sequence_reversal",
            'task.dataset_options=\'{"min_words": 1, "max_words": 6}\'',  # a JSON string
            "task.template={question} ",  # the question already asks for the list
            "batch.max_prompt_len=216",  # BOS + the longest question (204) + " " and room
            "batch.max_answer_len=80",  # "<answer>" + up to 59 characters + "</answer>" + EOS
            # Long sequences on a 2-core CPU: a smaller batch keeps a cell to minutes (the
            # full 8 x 8 shape took ~13 s per SFT step at load 10-16).
            "sft.steps=120",
            "sft.batch_size=16",
            "sft.micro_batch_size=16",
            "batch.groups_per_step=4",
            "batch.samples_per_group=8",
            "batch.micro_batch_size=32",
        ],
    ),
}


def cell_overrides(a, s: int) -> list[str]:
    return [
        f"total_steps={a.steps}", f"staleness={s}", "publish_every=1",
        f"controller.refuse_too_slow={a.refuse_too_slow}", f"seed={a.seed}",
        "rollout.eval_period=0",  # evaluations at start and end only: not what is measured
        "checkpoint.interval=1000000",  # no checkpoint mid-run: consumed payloads stay readable
        "optimizer.warmup_steps=3", "optimizer.end_lr_fraction=1.0",
    ]  # fmt: skip


def _mean_se(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None
    return statistics.fmean(values), se


def prompt_class(task: str, prompt: str, answer: str) -> str:
    """A coarse difficulty class of a prompt: answer digits (demo), the model's card (kuhn),
    words to reverse (reversal)."""
    if task == "demo":
        return f"{len(answer.lstrip('-'))} digit"
    if task == "kuhn":
        return prompt.split()[1].rstrip(".") if len(prompt.split()) > 1 else "?"
    return f"{answer.count(',') + 1} words"


def read_cell(db_path: str, task: str, slow_prefix: str) -> dict:
    """Every group's fate in one run's controller database, summarized per category."""
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    names = {
        r["worker_id"]: json.loads(r["profile"]).get("name", "")
        for r in conn.execute("SELECT worker_id, profile FROM workers")
    }
    workers = {
        r["lease_id"]: names.get(r["worker_id"], "")
        for r in conn.execute("SELECT lease_id, worker_id FROM leases")
    }
    kv = {r["key"]: json.loads(r["value"]) for r in conn.execute("SELECT * FROM kv")}
    groups = {r["group_id"]: dict(r) for r in conn.execute("SELECT * FROM groups")}
    consumed, dropped, never = [], [], []
    for g in groups.values():
        if g["state"] == "consumed":
            trajs = json.loads(g["payload"])
            lengths = [len(t["completion_token_ids"]) for t in trajs]
            rewards = [t["reward"] for t in trajs]
            worker = workers.get(g["lease_id"], "")
            consumed.append(_group(task, g, lengths, rewards, worker, slow_prefix))
        elif g["state"] == "queued" and g["attempts"] == 0:
            never.append(_group(task, g, None, None, "", slow_prefix))
    for d in conn.execute("SELECT * FROM dropped ORDER BY rowid"):
        g = groups[d["group_id"]]
        lengths, rewards = json.loads(d["lengths"]), json.loads(d["rewards"])
        worker = names.get(d["worker_id"] or "", "")
        dropped.append(_group(task, g, lengths, rewards, worker, slow_prefix))
    counted = kv.get("groups/consumed", 0)
    if counted != len(consumed):
        raise RuntimeError(
            f"{db_path}: {len(consumed)} consumed rows but groups/consumed={counted}: "
            "consumed trajectories were forgotten (a checkpoint mid-run?)"
        )
    in_flight = sum(g["state"] in ("leased", "buffered") for g in groups.values())
    by_prompt = {}
    for c in consumed:
        by_prompt.setdefault(c["prompt_id"], c)
    retried = [(d, by_prompt[d["prompt_id"]]) for d in dropped if d["prompt_id"] in by_prompt]
    drops_per_prompt: dict[str, int] = {}
    dropped_lengths: dict[str, list[float]] = {}
    for d in dropped:
        drops_per_prompt[d["prompt_id"]] = drops_per_prompt.get(d["prompt_id"], 0) + 1
        dropped_lengths.setdefault(d["prompt_id"], []).append(d["length"])
    # Each dropped prompt once: a prompt dropped ten times is one prompt's length, not ten.
    by_prompt_length = [statistics.fmean(v) for v in dropped_lengths.values()]
    conn.close()
    return {
        "consumed": summarize(consumed),
        # Drops come from the throttled worker: its own consumed groups are the comparison
        # that holds the worker fixed and leaves what the group is (length, prompt).
        "consumed_slow_worker": summarize([c for c in consumed if c["slow"]]),
        "dropped": summarize(dropped),
        "never_leased": summarize(never),
        "in_flight_at_end": in_flight,
        "dropped_then_consumed": len(retried),
        # A requeued group goes back to the front of the queue: the worker that returned it
        # late may lease it again at once, so the same prompts can be dropped over and over.
        "dropped_prompts": len(drops_per_prompt),
        "starved_prompts": sum(p not in by_prompt for p in drops_per_prompt),
        "max_drops_per_prompt": max(drops_per_prompt.values(), default=0),
        "dropped_prompt_length": statistics.fmean(by_prompt_length) if by_prompt_length else None,
        "retried_length_ratio": (
            statistics.fmean(d["length"] for d, _ in retried)
            / statistics.fmean(c["length"] for _, c in retried)
            if retried
            else None
        ),
        "counters": {
            k: kv.get(k) for k in ("groups/accepted", "groups/consumed", "staleness/dropped")
        },
    }


def _group(task, g, lengths, rewards, worker, slow_prefix) -> dict:
    return {
        "prompt_id": g["prompt_id"],
        "class": prompt_class(task, g["prompt"], g["answer"]),
        "answer_len": len(g["answer"]),
        "length": statistics.fmean(lengths) if lengths else None,
        "reward": statistics.fmean(rewards) if rewards else None,
        "slow": worker.startswith(slow_prefix),
    }


def summarize(gs: list[dict]) -> dict:
    out = {"groups": len(gs)}
    for key in ("length", "reward", "answer_len"):
        m, se = _mean_se([g[key] for g in gs if g[key] is not None])
        out[key], out[f"{key}_se"] = m, se
    out["slow_share"] = statistics.fmean(g["slow"] for g in gs) if gs else None
    classes: dict[str, int] = {}
    for g in gs:
        classes[g["class"]] = classes.get(g["class"], 0) + 1
    out["classes"] = {k: v / len(gs) for k, v in sorted(classes.items())}
    return out


def rows_of(cells: list[dict]) -> list[dict]:
    """The JSON's `rows`: one per (task, S, fate), the table's numbers."""
    keys = ("groups", "length", "length_se", "reward", "reward_se", "answer_len", "slow_share")
    return [
        {"task": c["task"], "S": c["S"], "fate": fate, **{k: c[fate][k] for k in keys}}
        for c in cells
        for fate in ("consumed", "dropped", "never_leased")
    ]


def headline_of(cell: dict) -> dict:
    c, d, n = cell["consumed"], cell["dropped"], cell["never_leased"]
    ratio = lambda x, y: None if x is None or not y else x / y
    gap = lambda x, y: None if x is None or y is None else x - y
    total = c["groups"] + d["groups"]
    return {
        "dropped_frac": d["groups"] / total if total else None,
        "length_bias": ratio(d["length"], c["length"]),
        "length_bias_by_prompt": ratio(cell["dropped_prompt_length"], c["length"]),
        "length_bias_same_worker": ratio(d["length"], cell["consumed_slow_worker"]["length"]),
        "reward_gap": gap(d["reward"], c["reward"]),
        "answer_len_ratio_dropped": ratio(d["answer_len"], c["answer_len"]),
        "answer_len_ratio_never_leased": ratio(n["answer_len"], c["answer_len"]),
        "starved_prompts": cell["starved_prompts"],
    }


def print_table(cells: list[dict]) -> None:
    f = lambda v, spec=".3f": "-" if v is None else format(v, spec)
    print(
        f"{'task':<9}{'S':>2} {'fate':<21}{'groups':>7}{'len':>8}{'±se':>7}{'reward':>8}"
        f"{'ans_len':>8}{'slow':>6}  classes"
    )
    for cell in cells:
        for fate in ("consumed", "consumed_slow_worker", "dropped", "never_leased"):
            r = cell[fate]
            classes = " ".join(f"{k}:{v:.2f}" for k, v in r["classes"].items())
            print(
                f"{cell['task']:<9}{cell['S']:>2} {fate:<21}{r['groups']:>7}"
                f"{f(r['length'], '.2f'):>8}{f(r['length_se'], '.2f'):>7}"
                f"{f(r['reward']):>8}{f(r['answer_len'], '.2f'):>8}"
                f"{f(r['slow_share'], '.2f'):>6}  {classes}"
            )
        h = cell["headline"]
        print(
            f"{'':<12}dropped_frac {f(h['dropped_frac'])}  length_bias {f(h['length_bias'])}"
            f"  reward_gap {f(h['reward_gap'], '+.3f')}  answer_len dropped/consumed "
            f"{f(h['answer_len_ratio_dropped'])}, never leased/consumed "
            f"{f(h['answer_len_ratio_never_leased'])}  (dropped then consumed "
            f"{cell['dropped_then_consumed']}, their length ratio "
            f"{f(cell['retried_length_ratio'])}; in flight at end {cell['in_flight_at_end']})"
        )
        print(
            f"{'':<12}{cell['dropped']['groups']} drops of {cell['dropped_prompts']} prompts "
            f"(at most {cell['max_drops_per_prompt']} of one); {cell['starved_prompts']} "
            "of them never consumed by the end; length bias with each dropped prompt once "
            f"{f(h['length_bias_by_prompt'])}, against the slow worker's own consumed groups "
            f"{f(h['length_bias_same_worker'])}"
        )


def cell_of(workdir: str, task: str, s: int, wall_s: float | None) -> dict:
    """One finished run's cell: its controller database read (`read_cell`), the headline."""
    cell = {"task": task, "S": s, "wall_s": wall_s}
    # the pool's second worker ("pool-b-", bench/sweep_cells.py) is the throttled one
    cell.update(read_cell(os.path.join(workdir, "controller.db"), task, "pool-b-"))
    cell["headline"] = headline_of(cell)
    return cell


def markdown(cells: list[dict]) -> str:
    """One row per (task, S): the table for docs/results.md."""
    f = lambda v, spec=".2f": "-" if v is None else format(v, spec)
    lines = [
        "| task | S | consumed / dropped groups | dropped frac | mean length consumed / "
        "dropped (tokens) | length bias (by group / by prompt / same worker) | reward consumed "
        "/ dropped | slow worker's share consumed / dropped | drops / prompts / starved |",
        "|" + "---|" * 9,
    ]
    for cell in cells:
        c, d, h = cell["consumed"], cell["dropped"], cell["headline"]
        lines.append(
            f"| {cell['task']} | {cell['S']} | {c['groups']} / {d['groups']} | "
            f"{f(h['dropped_frac'], '.3f')} | {f(c['length'])} / {f(d['length'])} | "
            f"{f(h['length_bias'], '.3f')} / {f(h['length_bias_by_prompt'], '.3f')} / "
            f"{f(h['length_bias_same_worker'], '.3f')} | "
            f"{f(c['reward'], '.3f')} / {f(d['reward'], '.3f')} | "
            f"{f(c['slow_share'])} / {f(d['slow_share'])} | {d['groups']} / "
            f"{cell['dropped_prompts']} / {cell['starved_prompts']} |"
        )
    return "\n".join(lines)


def run_task(a, task: str, stales: list[int], on_cell) -> None:
    from bench import sweep_cells
    from learner_jax import train

    config_file, pinned = TASKS[task]
    root = os.path.join(a.workdir, task)
    given = getattr(a, f"warm_start_{task}")
    shutil.rmtree(root, ignore_errors=True)
    base = os.path.join(root, "sft")
    if given:
        shutil.copytree(given, base)
    else:  # in this process, so every override is read as the cells read theirs
        print(f"{task}: SFT warm start -> {base}", flush=True)
        train.run(sweep_cells.load(config_file, ["total_steps=0", *pinned, *a.set]), base)
    first = sweep_cells.load(config_file, [*pinned, *a.set])
    pool = sweep_cells.Pool(first, os.path.join(root, "pool"), a.throttle_s)
    fixed = [*pinned, *pool.overrides(), *a.set]
    try:
        for s in stales:
            wd = os.path.join(root, f"S{s}")
            sweep_cells.copy_warm_start(base, wd)
            config = sweep_cells.load(config_file, [*fixed, *cell_overrides(a, s)])
            secs = sweep_cells.run_cell(config, wd, pool)
            cell = cell_of(wd, task, s, secs)
            on_cell(cell)
            print(f"  {task} S={s}: {secs:.0f} s, {cell['headline']}", flush=True)
    finally:
        pool.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--tasks", default="demo,kuhn,reversal")
    p.add_argument("--staleness", default="0,1,2,4")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--throttle_s", type=float, default=3.0)
    p.add_argument("--refuse_too_slow", action="store_true")
    for task in TASKS:
        p.add_argument(f"--warm_start_{task}", default="", help="reuse this SFT workdir")
    p.add_argument("--workdir", default="/tmp/echo2_staleness_bias")
    p.add_argument("--set", nargs="*", default=[], help="extra KEY=VALUE config overrides")
    p.add_argument("--render", default="", help="print the table of a saved JSON")
    p.add_argument(
        "--reread", action="store_true", help="no runs: rebuild --out from --workdir's runs"
    )
    a = p.parse_args()
    if a.render:
        with open(a.render) as f:
            cells = json.load(f)["cells"]
        print_table(cells)
        print(markdown(cells))
        return
    from bench import sweep_cells

    sweep_cells.enable_compile_cache(os.path.join(a.workdir, "jax_cache"))
    stales = [int(s) for s in a.staleness.split(",")]
    t0 = time.monotonic()
    cells: list[dict] = []

    def save(cell: dict | None) -> None:
        if cell is not None:
            cells.append(cell)
        headline = {
            f"{c['task']}_S{c['S']}_{k}": v for c in cells for k, v in c["headline"].items()
        }
        with open(a.out, "w") as f:
            out = {"headline": headline, "rows": rows_of(cells), "cells": cells, "args": vars(a)}
            json.dump({**out, "wall_s": time.monotonic() - t0}, f, indent=1)

    for task in a.tasks.split(","):
        if task not in TASKS:
            raise SystemExit(f"unknown task {task!r}; known: {', '.join(TASKS)}")
        if a.reread:  # the runs' wall times are in the JSON that ran them, not here
            for s in stales:
                wd = os.path.join(a.workdir, task, f"S{s}")
                if os.path.exists(os.path.join(wd, "controller.db")):
                    save(cell_of(wd, task, s, None))
        else:
            run_task(a, task, stales, save)
    print_table(cells)
    print(markdown(cells))
    print(f"wrote {a.out} after {time.monotonic() - t0:.0f} s (load {os.getloadavg()})")


if __name__ == "__main__":
    main()
