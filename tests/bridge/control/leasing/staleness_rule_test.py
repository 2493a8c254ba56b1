"""The staleness rule (bridge/contracts/staleness.py) means the same to every part that
applies it: for S in 0, 1, 2, 4 the real controller (SQLite), the planner's simulator (built
through `planner.sim_config` from a parsed fleet file) and the rule admit the same number of
groups for the same (learner step, newest version, worker version), drop the same buffered
groups, and the planner's fleet validation refuses the same schedules as the learner's."""

import types

import pytest
from controller_helpers import make, result, worker

from bridge.contracts import staleness
from bridge.control.protocol import LeaseRequest, Submission
from bridge.plan import fleet as fleet_lib
from bridge.plan import planner, simulate

G = 2  # groups per step
GROUP_SIZE = 2
ENOUGH = 1000  # more groups than any capacity below: a request is capped by admission only


def raw_fleet(S: int, admission: str = "held", groups_per_step: int = G, kappa: int = 1):
    return {
        "learner": {
            "step_s": 1.0,
            "rollouts_per_step": groups_per_step * GROUP_SIZE,
            "publish_s": 0.0,
            "price_per_hour": 1.0,
        },
        "model_bytes": 1e6,
        "staleness": S,
        "publish_every": kappa,
        "steps": 10,
        "group_size": GROUP_SIZE,
        "admission": admission,
        "workers": [{"name": "w", "count": 1, "price_per_hour": 1.0, "rollouts_per_s": 1.0,
                     "bandwidth_mb_s": 100.0}],
    }  # fmt: skip


def sim_for(S: int, admission: str, groups_per_step: int = G) -> simulate.Simulation:
    fleet = fleet_lib.parse(raw_fleet(S, admission, groups_per_step))
    return simulate.Simulation(planner.sim_config(fleet), workers=[])


def sim_admits(sim: simulate.Simulation, t: int, newest: int, x: int) -> int:
    """How many groups the simulator lets a worker at version x start, one by one."""
    sim.next_step, sim.newest, sim.leased, sim.buffer = t, newest, 0, []
    while sim.leased < ENOUGH and sim._admit(x):
        sim.leased += 1
    return sim.leased


def cases(S: int):
    """(learner's next step t, newest published P, worker version x, fetching P)."""
    for P in (0, 1, 3):
        for t in range(P, P + S + 3):
            yield t, P, P, False
            if P >= 1:
                yield t, P, P - 1, True  # fetching P in the background: works at P - 1
                yield t, P, P - 1, False  # behind: no work


@pytest.mark.parametrize("S", [0, 1, 2, 4])
def test_controller_simulator_and_rule_admit_the_same(tmp_path, S):
    ctl = make(tmp_path, staleness=S, groups_per_step=G, group_size=GROUP_SIZE,
               max_groups_per_lease=ENOUGH)  # fmt: skip
    w = worker(ctl, max_seqs=10 * ENOUGH)
    held, controller_mode = sim_for(S, "held"), sim_for(S, "controller")
    published, seen = -1, []
    for t, P, x, fetching in cases(S):
        if P > published:
            ctl.publish(P)
            published = P
        ctl.db.put("next_step", t)
        req = LeaseRequest(
            worker_version=x, max_groups=ENOUGH, fetching_version=P if fetching else -1
        )
        r = ctl.lease(w, req)
        got = 0 if r.lease is None else len(r.lease.groups)
        if r.lease is not None:
            assert ctl.release(w, r.lease.lease_id)  # back to nothing held for the next case
        else:
            assert r.reason in ("full", "behind"), r.reason
        # A fetching worker is what the simulator's "held" admission models, a worker that
        # swaps by downloading from the store its "controller" admission (m = 0).
        sim = held if fetching else controller_mode
        want = sim_admits(sim, t, P, x)
        rule = 0 if x < P and not fetching else staleness.admission_capacity(x, t, S, G)
        assert got == want == rule, (S, t, P, x, fetching, got, want, rule)
        seen.append(got)
    assert 0 in seen and max(seen) == (S + 1) * G  # both admitted and refused cases ran


@pytest.mark.parametrize("S", [0, 1, 2, 4])
def test_controller_and_simulator_drop_the_same_groups(tmp_path, S):
    versions = [0, 1, 2, 3, 4]
    ctl = make(tmp_path, staleness=S, groups_per_step=8, group_size=GROUP_SIZE,
               max_groups_per_lease=ENOUGH, max_leases_per_worker=len(versions))  # fmt: skip
    w = worker(ctl, max_seqs=ENOUGH)
    leases = []
    for v in versions:  # every token of a lease carries the version it was taken at
        ctl.publish(v)
        leases.append(ctl.lease(w, LeaseRequest(worker_version=v, max_groups=1)).lease)
    ctl.db.put("next_step", 4)
    for lease, v in zip(leases, versions, strict=True):
        sub = Submission(lease_id=lease.lease_id, groups=[result(lease.groups[0], (v, v, v))])
        assert len(ctl.submit(w, sub).accepted) == 1
    sim = sim_for(S, "held", groups_per_step=8)
    sim.buffer = [(v, 0.0) for v in versions]
    for t in range(4, 11):
        ctl.learner.drop_stale(t)
        kept = sorted(r["min_version"] for r in ctl.db.groups_in("buffered"))
        sim._drop_stale(t)
        assert kept == sorted(v for v, _ in sim.buffer), (S, t)
        assert kept == [v for v in versions if staleness.is_fresh(v, t, S)], (S, t)
    assert ctl.stats()["staleness/dropped"] == len(versions)


def test_planner_and_learner_refuse_the_same_schedules():
    from learner_jax import run_config

    for S in range(5):
        for kappa in range(1, 6):
            try:
                fleet_lib.parse(raw_fleet(S, kappa=kappa))
                planner_ok = True
            except fleet_lib.FleetError:
                planner_ok = False
            try:
                run_config.check_rl_schedule(
                    types.SimpleNamespace(staleness=S, publish_every=kappa)
                )
                learner_ok = True
            except ValueError:
                learner_ok = False
            assert planner_ok == learner_ok == (S >= staleness.min_staleness(kappa)), (S, kappa)
