"""The fleet planner: activation, the analytic capacity model, the simulation, cost.

`plan(fleet)` returns the PLAN.json dict:
1. Activation: every worker instance is an `activation.Offer` whose throughput is its
   rollouts/s times its expected availability 1 / (1 + preempt_rate * (restart + fetch)),
   so a flaky spot fleet is provisioned for what it delivers; `activation.decide` picks the
   cheapest set covering (1 + margin) * R / T.
2. Analytic: `capacity.py` with latency = publish_s + max over active workers of
   (broadcast delay + one lease), both from this plan's broadcast model, and the
   broadcast's period (links.period: versions it cannot carry are skipped).
3. Simulation: simulate.py on the active set.
4. Cost: learner, active workers and standby workers (standby_price_fraction * price) are
   billed for the whole wall time (a preempted spot worker's replacement is billed too).
   The centralized baseline is synchronous GRPO on the learner alone: each step generates R
   rollouts at learner.rollouts_per_s, then trains step_s, at the learner's price.
"""

from __future__ import annotations

import dataclasses

from bridge.control.fleet import activation, capacity
from bridge.plan import links, simulate
from bridge.plan.fleet import Fleet, WorkerType


def _restart_s(fleet: Fleet, w: WorkerType) -> float:
    return fleet.restart_s if w.restart_s is None else w.restart_s


def _lease_s(fleet: Fleet, w: WorkerType) -> float:
    return fleet.lease_s if w.lease_s is None else w.lease_s


def availability(fleet: Fleet, w: WorkerType) -> float:
    fetch = links.single_fetch_s(
        fleet.broadcast, fleet.model_bytes, w.bandwidth_mb_s, fleet.learner.uplink_mb_s
    )
    return 1.0 / (1.0 + w.preempt_per_hour / 3600.0 * (_restart_s(fleet, w) + fetch))


def activate(fleet: Fleet) -> tuple[dict[str, int], activation.Decision]:
    """Worker type -> active count, and the decision itself."""
    offers = [
        activation.Offer(
            f"{w.name}/{i}", w.price_per_hour, w.rollouts_per_s * availability(fleet, w)
        )
        for w in fleet.workers
        for i in range(w.count)
    ]
    required = capacity.required_rollouts_per_s(
        fleet.learner.rollouts_per_step, fleet.learner.step_s
    )
    decision = activation.decide(offers, required, margin=fleet.margin)
    active = {w.name: 0 for w in fleet.workers}
    for wid in decision.active:
        active[wid.rsplit("/", 1)[0]] += 1
    return active, decision


def worker_specs(fleet: Fleet, active: dict[str, int]) -> list[simulate.WorkerSpec]:
    return [
        simulate.WorkerSpec(
            wid=f"{w.name}/{i}",
            type_name=w.name,
            rollouts_per_s=w.rollouts_per_s,
            bandwidth_mb_s=w.bandwidth_mb_s,
            preempt_per_hour=w.preempt_per_hour,
            lease_s=_lease_s(fleet, w),
            restart_s=_restart_s(fleet, w),
        )
        for w in fleet.workers
        for i in range(active.get(w.name, 0))
    ]


def sim_config(fleet: Fleet) -> simulate.SimConfig:
    L = fleet.learner
    return simulate.SimConfig(
        step_s=L.step_s,
        rollouts_per_step=L.rollouts_per_step,
        publish_s=L.publish_s,
        model_bytes=fleet.model_bytes,
        version_bytes=fleet.version_bytes,
        staleness=fleet.staleness,
        publish_every=fleet.publish_every,
        steps=fleet.steps,
        broadcast=fleet.broadcast,
        uplink_mb_s=L.uplink_mb_s,
        chunk_mb=fleet.chunk_mb,
        fanout=fleet.fanout,
        group_size=fleet.group_size,
        admission=fleet.admission,
        max_version_lag=fleet.max_version_lag,
        seed=fleet.seed,
    )


def latency_s(fleet: Fleet, specs: list[simulate.WorkerSpec]) -> tuple[float, float]:
    """(T_pub + T_bcast + T_gen for the slowest active worker, T_bcast max)."""
    bw = [s.bandwidth_mb_s for s in specs]
    ds = links.delays(
        fleet.broadcast,
        fleet.wire_bytes,  # a new version: a delta's bytes when versions are deltas
        bw,
        fleet.learner.uplink_mb_s,
        fleet.chunk_mb,
        fleet.fanout,
    )
    gen = [simulate.slots_and_lease(s, fleet.group_size)[1] for s in specs]
    worst = max((d + g for d, g in zip(ds, gen, strict=True)), default=0.0)
    return fleet.learner.publish_s + worst, max(ds, default=0.0)


def broadcast_period_s(fleet: Fleet, specs: list[simulate.WorkerSpec]) -> float:
    """How soon the next version can enter the broadcast (links.period): capacity.py's
    kappa_eff = max(kappa, ceil(period / T)) when versions must be skipped."""
    bw = [s.bandwidth_mb_s for s in specs]
    ds = links.delays(
        fleet.broadcast, fleet.wire_bytes, bw, fleet.learner.uplink_mb_s, fleet.chunk_mb,
        fleet.fanout,
    )  # fmt: skip
    return links.period(
        fleet.broadcast, fleet.wire_bytes, bw, fleet.learner.uplink_mb_s, fleet.fanout, ds
    )


def baseline(fleet: Fleet) -> dict:
    L = fleet.learner
    if L.rollouts_per_s is None:
        return {"wall_s": None, "cost_usd": None, "note": "learner.rollouts_per_s not given"}
    gen_s = L.rollouts_per_step / L.rollouts_per_s
    wall = fleet.steps * (gen_s + L.step_s)
    return {
        "wall_s": wall,
        "cost_usd": L.price_per_hour * wall / 3600.0,
        "step_s": gen_s + L.step_s,
        "generate_s_per_step": gen_s,
        "utilization": L.step_s / (gen_s + L.step_s),
    }


def plan(fleet: Fleet) -> dict:
    """The PLAN.json dict (see the module docstring)."""
    L = fleet.learner
    active, decision = activate(fleet)
    specs = worker_specs(fleet, active)
    lat, bcast = latency_s(fleet, specs)
    period = broadcast_period_s(fleet, specs)
    rep = capacity.report(
        decision.active_rollouts_per_s,
        L.rollouts_per_step,
        L.step_s,
        fleet.staleness,
        fleet.publish_every,
        lat,
        period,
    )
    sim = simulate.simulate(sim_config(fleet), specs)
    wall = sim["wall_s"]
    by_name = {w.name: w for w in fleet.workers}
    fleet_per_h = sum(by_name[n].price_per_hour * k for n, k in active.items())
    standby_per_h = fleet.standby_price_fraction * sum(
        w.price_per_hour * (w.count - active[w.name]) for w in fleet.workers
    )
    cost = (L.price_per_hour + fleet_per_h + standby_per_h) * wall / 3600.0
    base = baseline(fleet)
    return {
        "active": active,
        "standby": {w.name: w.count - active[w.name] for w in fleet.workers},
        "cost_usd": cost,
        "cost_breakdown_usd": {
            "learner": L.price_per_hour * wall / 3600.0,
            "active_workers": fleet_per_h * wall / 3600.0,
            "standby_workers": standby_per_h * wall / 3600.0,
        },
        "cost_per_step_usd": cost / fleet.steps,
        "wall_s": wall,
        "predicted_utilization": sim["steady_utilization"],
        "utilization_whole_run": sim["utilization"],
        "analytic_utilization": rep.predicted_utilization,
        "min_staleness": rep.min_staleness,
        "staleness": fleet.staleness,
        "publish_every": fleet.publish_every,
        "required_rollouts_per_s": rep.required_rollouts_per_s,
        "active_rollouts_per_s": rep.active_rollouts_per_s,
        "shortfall_rollouts_per_s": decision.shortfall_rollouts_per_s,
        "latency_s": lat,
        "broadcast_s": bcast,
        "broadcast_period_s": period,
        "advice": rep.advice(fleet.staleness),
        "staleness_histogram": sim["staleness_histogram"],
        "dropped_rollouts": sim["dropped_rollouts"],
        "simulation": {
            k: v for k, v in sim.items() if k not in ("staleness_histogram", "dropped_rollouts")
        },
        "baseline": base,
        "cost_ratio": cost / base["cost_usd"] if base["cost_usd"] else None,
    }


def table(p: dict) -> str:
    """A short human-readable summary of a plan."""
    act = ", ".join(f"{n} x{k}" for n, k in p["active"].items() if k) or "none"
    b = p["baseline"]
    rows = [
        ("active workers", act),
        (
            "rollouts/s active / required",
            f"{p['active_rollouts_per_s']:.2f} / {p['required_rollouts_per_s']:.2f}",
        ),
        ("latency (pub+bcast+gen) s", f"{p['latency_s']:.1f} (bcast {p['broadcast_s']:.1f})"),
        ("S / min S (capacity.py)", f"{p['staleness']} / {p['min_staleness']}"),
        (
            "utilization sim / analytic",
            f"{p['predicted_utilization']:.3f} / {p['analytic_utilization']:.3f}",
        ),
        ("dropped rollouts", str(p["dropped_rollouts"])),
        ("wall h / cost USD", f"{p['wall_s'] / 3600:.2f} / {p['cost_usd']:.2f}"),
        ("cost per step USD", f"{p['cost_per_step_usd']:.3f}"),
    ]
    if b["cost_usd"] is not None:
        rows.append(
            ("baseline wall h / cost USD", f"{b['wall_s'] / 3600:.2f} / {b['cost_usd']:.2f}")
        )
        rows.append(("cost ratio echo2 / baseline", f"{p['cost_ratio']:.3f}"))
    if p["advice"]:
        rows.append(("advice", p["advice"]))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def with_overrides(fleet: Fleet, **kw) -> Fleet:
    """A copy with top-level fields (and `learner_<field>`) replaced; for sweeps and tests."""
    learner_kw = {k[len("learner_") :]: v for k, v in kw.items() if k.startswith("learner_")}
    top = {k: v for k, v in kw.items() if not k.startswith("learner_")}
    if learner_kw:
        top["learner"] = dataclasses.replace(fleet.learner, **learner_kw)
    return dataclasses.replace(fleet, **top)
