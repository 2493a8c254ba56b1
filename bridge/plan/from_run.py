"""The planner's input measured from a finished run, and the plan checked against that run.

    from bridge.plan import from_run
    fleet = from_run.fleet_from_run(WORKDIR)      # a FLEET.json dict (bridge/plan/fleet.py)
    cmp = from_run.compare(WORKDIR)               # plan vs measured, with relative errors

Everything comes from the run's own files (no jax: bridge imports neither framework):
- config.json: R = groups_per_step * samples_per_group, S, kappa, group size, the activation
  switch, margin and standby price fraction;
- metrics.jsonl (RL lines, last line per step, without the first: its wait is the workers'
  start-up, not the steady state the planner models): T = the mean `time/step_s` (the step
  as measured DURING the run, so on a shared CPU box it already carries the slowdown that
  generation inflicts on the learner; the mean, not the median, because utilization and cost
  are sums over steps and a loaded box gives step times a heavy tail), plus the learner's
  own time outside train steps and waits for data (held-out evaluation, checkpoints, taking
  and building each batch, bookkeeping: the wall time between lines minus `time/step_s` and
  `time/data_wait_s`, the part of `time/wait_s` with no batch at the controller), T_pub = the median
  non-zero `bridge/publish_s`, the number of steps;
- controller.db: each worker's price (its profile) and the controller's own throughput
  measurement (`fleet.rollouts_per_s`, fleet_plan.py: rollouts per busy second over its last
  leases), each worker's median lease duration (lease issue -> last accepted group), so the
  simulation runs as many groups at once as the worker did;
- swaps.jsonl: per worker the median publish -> first seen serving it, turned into a
  bandwidth (model bytes / delay), so the store broadcast reproduces the measured swap delay;
  planned with `admission="held"`: that delay is mostly the worker finishing the leases it
  holds on the old version (and its next poll), time in which it is busy, not idle. The
  "controller" admission would idle the worker for the whole delay, which is right for a
  download it waits on (a large model over a WAN) but here underpredicted utilization by
  17-30% on a quiet box (held: +1%; BUILD_NOTES "Planner vs a real run");
- the newest weight manifest: model bytes.

The learner is priced 0 here: `cost/usd` bills the fleet only, and it is the fleet's bill we
compare. An all-active run (`controller.activation=False`) is planned with every worker
active (the planner's activation would otherwise pick the cheapest cover, which is the other
arm); a cost-aware run with the run's own margin, so the planner picks its set from the
same measurements the controller used.

The planner has no term for the learner's time outside train steps, so the plan's step is
T + that overhead (the learner is on the critical path during an evaluation as during a
step) and its predicted utilization is the simulated one times T / (T + overhead):
`learner/utilization` counts train time only.

Measured side (`measured`): learner utilization = train time over wall time (each line's
wall time is its `time/step_s` / its `learner/utilization`; a plain mean of the per-line
ratios counts a line that waited 1 s like one that waited 10 ms and read 0.634 for a demo
run that trained 0.559 of its wall time) on the steady lines (`warm_rows`: the plan is of
the steady state; the run's warm-up, vLLM's compiles and first swaps, is not in it: with
the workers pinned to one core, plan_from_run_test's run was off by -8 to +1% on these
lines, +10 to +24% on every line after the first), also after the first line
(`utilization_after_first`) and over the second half, after activation has settled; cost
per step = the
`cost/usd` delta over them / steps (the bill accrues at contacts, so the first line's value
is not a clean start).
"""

from __future__ import annotations

import glob
import json
import os
import sqlite3
import statistics

from bridge.plan import fleet as fleet_lib
from bridge.plan import planner
from bridge.store.layout import LAYOUT

# An all-active plan: a margin no fleet covers makes activation.decide keep every worker.
_ALL_ACTIVE_MARGIN = 1e9


def _rl_rows(workdir: str) -> list[dict]:
    by_step = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                if row.get("phase") == "rl":
                    by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def _model_bytes(workdir: str, config: dict) -> float:
    store = config.get("bridge", {}).get("store") or os.path.join(workdir, "weights")
    manifests = sorted(glob.glob(os.path.join(store, LAYOUT.manifests, "*.json")))
    if not manifests:
        raise FileNotFoundError(f"no weight manifest under {store}/{LAYOUT.manifests}")
    with open(manifests[-1]) as f:
        return float(json.load(f)["total_bytes"])


def _version_bytes(rows: list[dict]) -> dict:
    """{"version_bytes": median measured bytes per version} when the run published deltas
    (`bridge/version_bytes` below the full size), else {} (every version was full)."""
    vb = [r["bridge/version_bytes"] for r in rows if r.get("bridge/version_bytes")]
    return {"version_bytes": float(statistics.median(vb))} if vb else {}


def _swap_delays(workdir: str) -> dict[str, float]:
    """worker_id -> median seconds from a version's publish to the worker serving it."""
    path, per = os.path.join(workdir, "swaps.jsonl"), {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if r.get("published_at"):
                    per.setdefault(r["worker_id"], []).append(
                        max(0.0, r["seen_at"] - r["published_at"])
                    )
    return {w: statistics.median(d) for w, d in per.items()}


def _workers(workdir: str, group_size: int) -> list[dict]:
    """Per worker: id, price, measured rollouts/s, mean lease seconds, standby at the end."""
    db = sqlite3.connect(f"file:{os.path.join(workdir, 'controller.db')}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    try:
        fleet = {r["worker_id"]: r for r in db.execute("SELECT * FROM fleet")}
        # One lease's duration: issued -> its last group accepted (what fleet_plan measures).
        leases = db.execute(
            "SELECT l.worker_id, MAX(g.accepted_at) - l.created_at AS dur FROM leases l "
            "JOIN groups g ON g.lease_id = l.lease_id WHERE g.accepted_at IS NOT NULL "
            "GROUP BY l.lease_id"
        ).fetchall()
        out = []
        for w in db.execute("SELECT * FROM workers ORDER BY registered_at"):
            f, profile = fleet.get(w["worker_id"]), json.loads(w["profile"])
            mu = None if f is None else f["rollouts_per_s"]
            durs = [r["dur"] for r in leases if r["worker_id"] == w["worker_id"]]
            if not durs and mu:
                # Consumed groups are pruned, so a worker that went on standby early has no
                # lease left to time: a full lease (the controller's cap, whole groups of
                # group_size) at its measured speed.
                full = profile.get("max_concurrent_sequences", 0) // group_size * group_size
                durs = [max(full, group_size) / mu]
            out.append(
                {
                    "worker_id": w["worker_id"],
                    "price_per_hour": profile["price_per_hour"],
                    "rollouts_per_s": mu,
                    "lease_s": statistics.median(durs) if durs else 0.0,
                    "standby": bool(f is not None and f["standby"]),
                }
            )
        return out
    finally:
        db.close()


def _steady_rows(workdir: str) -> list[dict]:
    rows = _rl_rows(workdir)[1:]
    if len(rows) < 2:
        raise ValueError(f"{workdir}: fewer than 3 RL lines in metrics.jsonl")
    return rows


def _data_wait(row: dict) -> float:
    """The learner's wait with no batch at the controller (older runs: its whole wait)."""
    return row.get("time/data_wait_s", row["time/wait_s"])


def learner_times(rows: list[dict]) -> tuple[float, float]:
    """(mean train step s, mean learner seconds per step outside train steps and waits).

    The second leaves out the gaps next to a line whose window held an XLA compile
    (`time/compiled`, learner_jax/reporting/compiles.py): a one-off, which the plan of a steady
    state must not charge to every step, as the live model does not (on a 30-step demo run the
    first audit re-score's ~1 s compile made it 0.070 s; 0.042 s without it)."""
    step = statistics.fmean(r["time/step_s"] for r in rows)
    pairs = list(zip(rows, rows[1:], strict=False))
    warm = [(a, b) for a, b in pairs if not (a.get("time/compiled") or b.get("time/compiled"))]
    other = [
        max(0.0, b["time/wall"] - a["time/wall"] - b["time/step_s"] - _data_wait(b))
        for a, b in (warm or pairs)
    ]
    return step, statistics.fmean(other)


def fleet_from_run(workdir: str) -> dict:
    """The FLEET.json dict of a finished run (see the module docstring)."""
    with open(os.path.join(workdir, "config.json")) as f:
        config = json.load(f)
    rows = _steady_rows(workdir)
    step_s, overhead_s = learner_times(rows)
    batch, ctl = config["batch"], config.get("controller", {})
    model_bytes = _model_bytes(workdir, config)
    swaps = _swap_delays(workdir)
    publish = [r["bridge/publish_s"] for r in rows if r.get("bridge/publish_s")]
    workers = []
    for w in _workers(workdir, batch["samples_per_group"]):
        if not w["rollouts_per_s"]:
            continue  # never completed a lease: nothing measured to plan with
        delay = max(swaps.get(w["worker_id"], 0.0), 1e-3)
        workers.append(
            {
                "name": w["worker_id"],
                "count": 1,
                "price_per_hour": w["price_per_hour"],
                "rollouts_per_s": w["rollouts_per_s"],
                "bandwidth_mb_s": model_bytes / 1e6 / delay,
                "lease_s": w["lease_s"],
            }
        )
    activation = bool(ctl.get("activation", False))
    return {
        "name": f"measured from {workdir}",
        "learner": {
            "step_s": step_s + overhead_s,
            "rollouts_per_step": batch["groups_per_step"] * batch["samples_per_group"],
            "publish_s": statistics.median(publish) if publish else 0.0,
            "price_per_hour": 0.0,
        },
        "model_bytes": model_bytes,
        **_version_bytes(rows),
        # staleness="auto" moved S up to staleness_max: plan for the most it could use
        "staleness": config["staleness_max"]
        if config["staleness"] == "auto"
        else config["staleness"],
        "publish_every": config["publish_every"],
        "steps": len(rows),
        "margin": ctl.get("activation_margin", 0.1) if activation else _ALL_ACTIVE_MARGIN,
        "broadcast": "store",
        "group_size": batch["samples_per_group"],
        "standby_price_fraction": ctl.get("standby_price_fraction", 0.0),
        "admission": "held",  # see the module docstring
        "workers": workers,
    }


def measured(workdir: str) -> dict:
    """What the run itself says: utilization, cost per step, wall per step, final set."""
    every = _rl_rows(workdir)
    rows = _steady_rows(workdir)
    warm = warm_rows(rows)
    half = rows[len(rows) // 2 :]
    span = len(rows) - 1
    step_s, overhead_s = learner_times(rows)
    return {
        "steps": len(rows),
        "utilization_all_lines": train_share(every),
        "utilization": train_share(warm or rows),
        "utilization_lines": len(warm or rows),
        "utilization_after_first": train_share(rows),
        "utilization_second_half": train_share(half),
        "cost_per_step_usd": (rows[-1]["cost/usd"] - rows[0]["cost/usd"]) / span,
        "cost_per_step_second_half_usd": (half[-1]["cost/usd"] - half[0]["cost/usd"])
        / max(1, len(half) - 1),
        "wall_per_step_s": (rows[-1]["time/wall"] - rows[0]["time/wall"]) / span,
        "step_s_mean": step_s,
        "learner_overhead_s": overhead_s,
        "step_s_median": statistics.median(r["time/step_s"] for r in rows),
        "active_workers_at_end": rows[-1]["fleet/active_workers"],
    }


def warm_rows(rows: list[dict]) -> list[dict]:
    """The lines of the steady state: the live model had warm samples of every input
    (`capacity/confident`) and no XLA compile ran in the line's window; [] if under two."""
    warm = [r for r in rows if r.get("capacity/confident") and not r.get("time/compiled")]
    return warm if len(warm) >= 2 else []


def train_share(rows: list[dict]) -> float:
    """The learner's train time over its wall time on these metrics lines."""
    walls = [r["time/step_s"] / max(r["learner/utilization"], 1e-9) for r in rows]
    return sum(r["time/step_s"] for r in rows) / sum(walls)


def _rel(pred: float, meas: float) -> float | None:
    return None if not meas else (pred - meas) / meas


def compare(workdir: str) -> dict:
    """Plan the run's measured fleet and set the plan beside the run's own numbers."""
    raw = fleet_from_run(workdir)
    plan = planner.plan(fleet_lib.parse(raw))
    meas = measured(workdir)
    train_share = meas["step_s_mean"] / raw["learner"]["step_s"]
    pred = {
        "utilization": plan["predicted_utilization"] * train_share,
        "analytic_utilization": plan["analytic_utilization"] * train_share,
        "learner_busy_utilization": plan["predicted_utilization"],
        "cost_per_step_usd": plan["cost_per_step_usd"],
        "wall_per_step_s": plan["wall_s"] / raw["steps"],
        "active": sorted(n for n, k in plan["active"].items() if k),
        "active_workers": sum(plan["active"].values()),
        "active_price_per_hour": sum(
            w["price_per_hour"] for w in raw["workers"] if plan["active"].get(w["name"])
        ),
    }
    return {
        "fleet": raw,
        "plan": pred,
        "measured": meas,
        "error": {
            "utilization": _rel(pred["utilization"], meas["utilization"]),
            "utilization_second_half": _rel(pred["utilization"], meas["utilization_second_half"]),
            "cost_per_step": _rel(pred["cost_per_step_usd"], meas["cost_per_step_usd"]),
            "cost_per_step_second_half": _rel(
                pred["cost_per_step_usd"], meas["cost_per_step_second_half_usd"]
            ),
        },
        "same_active_count": pred["active_workers"] == meas["active_workers_at_end"],
    }
