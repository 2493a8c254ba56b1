"""What a run shows a person: the live line per RL step, and the end-of-run report.

    python -m learner_jax.report --workdir=/tmp/echo2_demo     # re-draw from the files

`live_line(metrics, end_step)` is one compact line per learner step (step, reward,
held-out accuracy when evaluated, staleness, learner utilization, active workers, cost).

`write_report(workdir)` reads `metrics.jsonl` (RL lines), `eval.jsonl` (held-out
accuracy: "before" = right after SFT, "rl" = during RL, "after" = at the end, "stop" =
when interrupted) and
`swaps.jsonl` (when the controller first saw each worker serve each version, next to the
version's publish time) and `broadcast.jsonl` (each worker's reported fetch of each
version: publish -> verified, bytes from the store and from peers) and writes, into the
workdir, matplotlib (Agg) PNGs:

    reward.png        reward/mean per step and held-out accuracy
    utilization.png   learner/utilization per step
    staleness.png     histogram of trajectory staleness (learner step - sampling version)
    swap_latency.png  seconds from publish to each worker's swap, per version
    cost.png          cumulative fleet cost (USD) over steps

plus `summary.md` (before/after held-out accuracy, wall time, means, the capacity model's
predicted vs the measured utilization, per-worker swap and broadcast latency, store bytes
per version) and returns its path.
"""

from __future__ import annotations

import math
import os
import statistics
from collections import defaultdict

from absl import app, flags

from learner_jax.metrics import METRICS_FILE, read_jsonl
from learner_jax.rl.evals import EVAL_FILE
from learner_jax.rl.swaps import BROADCAST_FILE, SWAPS_FILE

PROVISION_FILE = "provisioner.jsonl"  # bridge/fleet/provisioner.py's log


def live_line(m: dict, end_step: int) -> str:
    return " | ".join([f"step {m['step']:>5}/{end_step}", live_fields(m)])


def live_fields(m: dict) -> str:
    """The live line without its step (a progress bar shows the step itself)."""
    acc = m.get("eval/accuracy")
    parts = [
        f"reward {m.get('reward/mean', float('nan')):.3f}",
        f"acc {acc:.3f}" if acc is not None else "acc   -  ",
        f"stale {m.get('staleness/mean', float('nan')):.2f}/{m.get('staleness/max', 0):.0f}",
        f"util {m.get('learner/utilization', float('nan')):.2f}",
        f"workers {m.get('fleet/active_workers', 0):.0f}"
        + (f" ({slow:.0f} too slow)" if (slow := m.get("fleet/too_slow_workers", 0)) else ""),
        f"${m.get('cost/usd', 0.0):.4f}",
        f"wait {m.get('time/wait_s', 0.0):.2f}s",
    ]
    if m.get("capacity/warning"):  # the capacity model says the learner will wait (fleet_plan)
        short = m.get("capacity/active_rollouts_per_s", 0.0) < m.get(
            "capacity/required_rollouts_per_s", 0.0
        )  # else the warning is freshness: the latencies need a larger staleness bound
        need = "more workers" if short else f"S>={m.get('capacity/min_staleness', 0):.0f}"
        parts.append(f"capacity: needs {need} (see log)")
    return " | ".join(parts)


def rl_rows(workdir: str) -> list[dict]:
    """RL metrics lines, the last line of each step (a resumed run may repeat steps)."""
    by_step = {}
    for row in read_jsonl(os.path.join(workdir, METRICS_FILE)):
        if row.get("phase") == "rl":
            by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def swap_latencies(workdir: str) -> dict[str, list[tuple[int, float]]]:
    """worker label -> [(version, seconds from publish to first seen serving it)]."""
    out = defaultdict(list)
    for r in read_jsonl(os.path.join(workdir, SWAPS_FILE)):
        if r.get("published_at"):
            label = f"{r['worker_id']} (${r['price_per_hour']:.2f}/h)"
            out[label].append((r["version"], max(0.0, r["seen_at"] - r["published_at"])))
    return dict(out)


def _plot(path, draw):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    draw(ax)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _series(rows, key):
    pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def write_report(workdir: str) -> str:
    rows = rl_rows(workdir)
    evals = read_jsonl(os.path.join(workdir, EVAL_FILE))
    swaps = swap_latencies(workdir)

    def reward(ax):
        ax.plot(*_series(rows, "reward/mean"), label="reward/mean (rollouts)", alpha=0.7)
        if evals:
            ax.plot(
                [e["step"] for e in evals],
                [e["accuracy"] for e in evals],
                "o-",
                label="held-out accuracy",
            )
        ax.set_xlabel("learner step")
        ax.set_ylim(-0.02, 1.02)
        ax.legend()

    def util(ax):
        ax.plot(*_series(rows, "learner/utilization"))
        ax.set_xlabel("learner step")
        ax.set_ylabel("learner utilization")
        ax.set_ylim(0, 1.05)

    def stale(ax):
        hist = defaultdict(float)
        for r in rows:
            for k, v in r.items():
                if k.startswith("staleness/lag_") and v:
                    hist[int(k.rsplit("_", 1)[1])] += v
        lags = sorted(hist)
        ax.bar(lags, [hist[k] for k in lags])
        ax.set_xlabel("staleness (learner step - sampling version)")
        ax.set_ylabel("trajectories")

    def swap(ax):
        for label, pts in sorted(swaps.items()):
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ".-", label=label)
        ax.set_xlabel("version")
        ax.set_ylabel("publish -> swap (s)")
        if swaps:
            ax.legend(fontsize=7)

    def cost(ax):
        ax.plot(*_series(rows, "cost/usd"))
        ax.set_xlabel("learner step")
        ax.set_ylabel("cumulative fleet cost (USD)")

    for name, draw in (
        ("reward.png", reward),
        ("utilization.png", util),
        ("staleness.png", stale),
        ("swap_latency.png", swap),
        ("cost.png", cost),
    ):
        _plot(os.path.join(workdir, name), draw)
    path = os.path.join(workdir, "summary.md")
    with open(path, "w") as f:
        fetches = read_jsonl(os.path.join(workdir, BROADCAST_FILE))
        provisions = read_jsonl(os.path.join(workdir, PROVISION_FILE))
        f.write(summary(rows, evals, swaps, fetches, provisions))
    return path


def summary(rows: list[dict], evals: list[dict], swaps: dict, fetches=(), provisions=()) -> str:
    by_tag = {}
    for e in evals:
        by_tag[e["tag"]] = e
    before, after = by_tag.get("before"), by_tag.get("after")

    def mean(key):
        vals = [r[key] for r in rows if r.get(key) is not None]
        return statistics.fmean(vals) if vals else float("nan")

    lines = ["# echo2 run summary", ""]
    if before:
        lines.append(
            f"- held-out accuracy after SFT (step {before['step']}): {before['accuracy']:.3f}"
        )
    if after:
        lines.append(
            f"- held-out accuracy after RL (step {after['step']}): {after['accuracy']:.3f}"
        )
    stop = by_tag.get("stop")
    if stop and not after:
        lines.append(
            f"- held-out accuracy when stopped early (step {stop['step']}): {stop['accuracy']:.3f}"
        )
    if before and after:
        lines.append(f"- change: {100 * (after['accuracy'] - before['accuracy']):+.1f} points")
    if rows:
        walls = [r["time/wall"] for r in rows if r.get("time/wall")]
        wall = f"{walls[-1] - walls[0]:.0f} s" if len(walls) > 1 else "-"
        k = max(1, len(rows) // 10)
        first = statistics.fmean(r["reward/mean"] for r in rows[:k])
        last = statistics.fmean(r["reward/mean"] for r in rows[-k:])
        max_stale = max(r.get("staleness/max", 0) for r in rows)
        kls = [r["mismatch/kl"] for r in rows if r.get("mismatch/tokens")]
        lines += [
            f"- RL steps: {len(rows)} (steps {rows[0]['step']}..{rows[-1]['step']})",
            f"- RL wall time: {wall}",
            f"- reward/mean: first {k} steps {first:.3f}, last {k} steps {last:.3f}",
            f"- learner utilization (mean): {mean('learner/utilization'):.3f}",
            f"- staleness mean {mean('staleness/mean'):.2f}, max {max_stale:.0f}, "
            f"dropped groups {rows[-1].get('staleness/dropped', 0)}",
            f"- fleet cost: ${rows[-1].get('cost/usd', 0.0):.4f}",
            f"- mismatch/kl, mean over steps with on-policy rows: "
            f"{statistics.fmean(kls) if kls else float('nan'):.2e}",
        ]
        lines += utilization_lines(rows)
        blocking = [
            r["bridge/publish_blocking_s"] for r in rows if "bridge/publish_blocking_s" in r
        ]
        if blocking:  # background publishing: what the learner still waited for
            lines.append(
                f"- publishing in the background: median {statistics.median(blocking):.3f} s "
                "on the learner's thread per version, "
                f"{rows[-1].get('bridge/publish_skipped', 0)} versions skipped (a newer one won)"
            )
        lines += version_bytes_lines(rows)
    for label, pts in sorted(swaps.items()):
        secs = [p[1] for p in pts]
        med = statistics.median(secs)
        lines.append(f"- publish -> swap, {label}: median {med:.2f} s over {len(secs)} versions")
    lines += too_slow_lines(list(provisions))
    lines += broadcast_lines(list(fetches))
    lines += [
        "",
        "Plots: reward.png, utilization.png, staleness.png, swap_latency.png, cost.png; "
        "metrics in metrics.jsonl and tb/ (TensorBoard).",
        "",
    ]
    return "\n".join(lines)


def version_bytes_lines(rows: list[dict]) -> list[str]:
    """What each published version added to the store (`bridge/version_bytes`, bridge/weights/)
    and the changed fraction of the versions stored as deltas (`bridge/delta_density` < 1;
    1.0 is logged for a version that was not compared: a full one)."""
    vbytes = [r["bridge/version_bytes"] for r in rows if "bridge/version_bytes" in r]
    if not vbytes:
        return []
    dens = [r["bridge/delta_density"] for r in rows if r.get("bridge/delta_density", 1.0) < 1.0]
    what = (
        f"changed elements median {100 * statistics.median(dens):.2f}% over {len(dens)} "
        "delta versions"
        if dens
        else "every version full (bridge.delta off: on by default for s3/gcs stores)"
    )
    return [
        f"- bytes per version: median {statistics.median(vbytes) / 1e6:.3f} MB "
        f"(max {max(vbytes) / 1e6:.3f} MB) over {len(vbytes)} publishing steps, {what}"
    ]


def utilization_lines(rows: list[dict]) -> list[str]:
    """The capacity model's live predictions (bridge/control/fleet/fleet_plan.py: warm measurements
    only) against the learner utilization of the same steps, over the steps with a confident
    prediction (the fleet's speed and T move with the machine's load, so one early
    prediction is judged against the steps it was made for), and the first one. Both are
    weighted by each step's wall time: utilization is train time over wall time, and a plain
    mean of per-step ratios counts a step that waited 2 s like one that waited 10 ms (on a
    quiet 2-core box that mean read 0.597 for a run that trained 0.456 of its wall time).
    Steps in which XLA compiled (`time/compiled`) are left out of both: the prediction is of
    the steady state and leaves compiles out (learner_jax/compiles.py)."""
    conf = [r for r in rows if r.get("capacity/confident")]
    util = [r for r in rows if r.get("learner/utilization") and "time/step_s" in r]
    if not conf:
        measured = f"{time_weighted(util, 'learner/utilization'):.3f}" if util else "-"
        return [
            "- predicted vs measured utilization: no confident prediction (too few warm "
            f"measurements); measured {measured}"
        ]
    first, k = conf[0]["capacity/predicted_utilization"], conf[0]["step"]
    pairs = [r for r in conf if r.get("learner/utilization") and "time/step_s" in r]
    compiled = sum(1 for r in pairs if r.get("time/compiled"))
    pairs = [r for r in pairs if not r.get("time/compiled")]
    predicted = time_weighted(pairs, "capacity/predicted_utilization")
    measured = time_weighted(pairs, "learner/utilization")
    warned = sum(1 for r in rows if r.get("capacity/warning"))
    return [
        f"- predicted vs measured utilization: {predicted:.3f} predicted vs {measured:.3f} "
        f"measured ({100 * (predicted - measured):+.1f} points) over the {len(pairs)} steps "
        f"with a confident prediction (the first at step {k}: {first:.3f}; {compiled} with an "
        f"XLA compile left out); capacity warning on {warned} of {len(rows)} steps"
    ]


def time_weighted(rows: list[dict], key: str) -> float:
    """Mean of `key` over metrics lines, each weighted by its wall time (train time over
    utilization: one RL step per line); the measured utilization is then the run's train
    time over its wall time. NaN for no rows."""
    walls = [r["time/step_s"] / r["learner/utilization"] for r in rows]
    total = sum(walls)
    return sum(r[key] * w for r, w in zip(rows, walls, strict=True)) / total if total else math.nan


def too_slow_lines(provisions: list[dict]) -> list[str]:
    """Workers the fleet released as too slow (learner_jax/rl/fleet.py, provisioner.jsonl):
    the time they were refused work but paid for."""
    slow = [e for e in provisions if e.get("event") == "stop" and "idle_s" in e]
    if not slow:
        return []
    names = ", ".join(f"{e['name']} (${e['price_per_hour']:.2f}/h)" for e in slow)
    return [
        f"- released as too slow: {len(slow)} worker(s), {names}; paid idle before release "
        f"{sum(e['idle_s'] for e in slow):.0f} s, ${sum(e['idle_usd'] for e in slow):.4f}"
    ]


def broadcast_lines(fetches: list[dict]) -> list[str]:
    """Per worker: median publish -> verified and MB from the store / from peers per
    version; per version: all workers' store bytes in model copies (1 = peer broadcast
    working, N = every worker read the store)."""
    if not fetches:
        return []
    out, by_worker, by_version = [], defaultdict(list), defaultdict(list)
    for r in fetches:
        by_worker[r["worker_id"]].append(r)
        by_version[r["version"]].append(r)
    for wid, rs in sorted(by_worker.items()):
        med = {k: statistics.median(r[k] for r in rs)
               for k in ("latency_s", "bytes_from_store", "bytes_from_peers")}  # fmt: skip
        out.append(
            f"- broadcast, {wid}: publish -> verified median {med['latency_s']:.2f} s, "
            f"{med['bytes_from_store'] / 1e6:.3f} MB from the store and "
            f"{med['bytes_from_peers'] / 1e6:.3f} MB from peers per version ({len(rs)} versions)"
        )
    model = statistics.median(r["bytes_from_store"] + r["bytes_from_peers"] for r in fetches)
    store = [sum(r["bytes_from_store"] for r in rs) for rs in by_version.values()]
    out.append(
        f"- store bytes per version, all workers: median {statistics.median(store) / 1e6:.3f} "
        f"MB = {statistics.median(store) / max(model, 1):.2f} model copies "
        f"({len(by_version)} versions)"
    )
    return out


def main(argv):
    del argv
    print(write_report(flags.FLAGS.workdir))


if __name__ == "__main__":
    # Defined here, not at import: the training binary imports this module and owns --workdir.
    flags.DEFINE_string("workdir", None, "run directory with metrics.jsonl", required=True)
    app.run(main)
