"""The fleet planner: input validation, the simulation against capacity.py, the CLI."""

import json
import os
import subprocess
import sys

import pytest

from bridge.control.fleet import capacity
from bridge.plan import fleet as fleet_lib
from bridge.plan import links, planner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def raw_fleet(**top):
    """T = 10 s, R = 64, one worker type; leases of 4 rollouts, broadcast ~1 s."""
    raw = {
        "learner": {
            "step_s": 10.0,
            "rollouts_per_step": 64,
            "publish_s": 1.0,
            "price_per_hour": 10.0,
            "rollouts_per_s": 4.0,
        },
        "model_bytes": 1e8,
        "staleness": 4,
        "publish_every": 1,
        "steps": 60,
        "group_size": 4,
        "margin": 0.0,
        "workers": [
            {
                "name": "w",
                "count": 16,
                "price_per_hour": 0.3,
                "rollouts_per_s": 0.4,
                "bandwidth_mb_s": 100.0,
            }
        ],
    }
    raw.update(top)
    return raw


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda r: r.update(bogus=1), "bogus"),
        (lambda r: r["learner"].update(step_seconds=1), "step_seconds"),
        (lambda r: r["workers"][0].update(price_per_hour=-1), "workers[0].price_per_hour"),
        (lambda r: r["workers"][0].pop("bandwidth_mb_s"), "workers[0].bandwidth_mb_s"),
        (lambda r: r.pop("model_bytes"), "model_bytes"),
        (lambda r: r["learner"].update(step_s=0), "learner.step_s"),
        (lambda r: r.update(staleness=1.5), "staleness"),
        (lambda r: r.update(broadcast="carrier_pigeon"), "broadcast"),
        (lambda r: r.update(staleness=1, publish_every=3), "staleness"),
        (lambda r: r["workers"].append(dict(r["workers"][0])), "duplicate"),
        (lambda r: r.update(workers=[]), "workers"),
    ],
)
def test_validation_names_the_field(mutate, field):
    raw = raw_fleet()
    mutate(raw)
    with pytest.raises(fleet_lib.FleetError, match=field.replace("[", r"\[").replace("]", r"\]")):
        fleet_lib.parse(raw)


def test_ample_fleet_keeps_learner_busy_without_drops():
    raw = raw_fleet(staleness=6, margin=0.5)
    raw["workers"][0]["count"] = 40
    p = planner.plan(fleet_lib.parse(raw))
    assert p["active"]["w"] == 24  # ceil(1.5 * 6.4 / 0.4): activation covers (1 + margin) R/T
    assert p["predicted_utilization"] > 0.99
    assert p["analytic_utilization"] == pytest.approx(1.0)
    assert p["dropped_rollouts"] == 0
    assert sum(p["staleness_histogram"].values()) == 60 * 64
    assert max(int(k) for k in p["staleness_histogram"]) <= 6


def test_half_the_throughput_gives_half_utilization():
    raw = raw_fleet(staleness=6)
    raw["workers"][0]["count"] = 8  # 3.2 rollouts/s, half of R / T
    p = planner.plan(fleet_lib.parse(raw))
    assert p["shortfall_rollouts_per_s"] == pytest.approx(3.2)
    assert p["analytic_utilization"] == pytest.approx(0.5)
    assert p["predicted_utilization"] == pytest.approx(0.5, abs=0.03)


@pytest.mark.parametrize("kappa", [1, 2])
def test_stall_threshold_matches_min_staleness(kappa):
    """Exactly the required throughput: busy at S = min S, stalling one below."""
    fleet = fleet_lib.parse(raw_fleet(publish_every=kappa))
    lat, _ = planner.latency_s(fleet, planner.worker_specs(fleet, {"w": 16}))
    s_min = capacity.min_staleness(kappa, 10.0, lat)
    assert s_min == kappa + 2  # latency = 1 + 1 + 10 s
    util = {
        s: planner.plan(planner.with_overrides(fleet, staleness=s))["predicted_utilization"]
        for s in (s_min - 1, s_min)
    }
    assert util[s_min] > 0.98
    assert util[s_min - 1] < 0.975


def test_kappa_s_minus_1_stalls_above_latency_t_not_2t():
    """PAPER.md's reading (latency <= 2 T under kappa = S - 1) against ours (<= T)."""
    utils = {}
    for latency_over_t in (0.8, 1.6):
        raw = raw_fleet(staleness=3, publish_every=2, group_size=1)
        raw["learner"]["publish_s"] = latency_over_t * 10.0 - 3.5  # + 1 s bcast + 2.5 s lease
        fleet = fleet_lib.parse(raw)
        lat, _ = planner.latency_s(fleet, planner.worker_specs(fleet, {"w": 16}))
        assert lat == pytest.approx(latency_over_t * 10.0)
        utils[latency_over_t] = planner.plan(fleet)["predicted_utilization"]
    assert utils[0.8] > 0.98
    assert utils[1.6] < 0.95  # stalls although latency < 2 T


def test_deterministic_for_a_seed_with_preemptions():
    raw = raw_fleet(seed=3, restart_s=20.0)
    raw["workers"][0]["preempt_per_hour"] = 30.0
    a = planner.plan(fleet_lib.parse(raw))
    b = planner.plan(fleet_lib.parse(raw))
    c = planner.plan(fleet_lib.parse({**raw, "seed": 4}))
    assert a["simulation"]["preemptions"] > 0
    assert a == b
    assert a["wall_s"] != c["wall_s"]


def test_broadcast_formulas_match_paper_for_equal_links():
    m, n, bw, chunk = 1e9, 8, 100.0, 10.0
    assert max(links.delays("store", m, [bw] * n, uplink_mb_s=200.0)) == pytest.approx(
        n * 1000 / 200
    )
    assert max(links.delays("chain", m, [bw] * n, chunk_mb=chunk)) == pytest.approx(
        (1000 + (n - 1) * chunk) / bw
    )
    # Fan-out 2, 6 nodes: depth 2; the uplink is shared by two children at each level.
    tree = links.delays("tree", m, [bw] * 6, uplink_mb_s=bw, chunk_mb=chunk, fanout=2)
    assert max(tree) == pytest.approx(2 * (1000 + chunk) / bw)


def test_cli_writes_plan_and_baseline(tmp_path):
    path = tmp_path / "fleet.json"
    path.write_text(json.dumps(raw_fleet(steps=20)))
    out = tmp_path / "plan.json"
    cmd = [sys.executable, "-m", "bridge.plan", f"--fleet={path}", f"--out={out}"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    p = json.loads(out.read_text())
    for key in (
        "active",
        "cost_usd",
        "wall_s",
        "predicted_utilization",
        "analytic_utilization",
        "min_staleness",
        "staleness_histogram",
        "dropped_rollouts",
        "cost_per_step_usd",
    ):
        assert key in p
    # Baseline: 20 steps of 64 / 4 = 16 s generation + 10 s training at 10 USD/h.
    assert p["baseline"]["wall_s"] == pytest.approx(20 * 26.0)
    assert p["cost_ratio"] == pytest.approx(p["cost_usd"] / (10.0 * 520 / 3600))
    assert "cost ratio" in res.stdout
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**raw_fleet(), "stalenes": 3}))
    res = subprocess.run(
        [sys.executable, "-m", "bridge.plan", f"--fleet={bad}", f"--out={out}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 2 and "stalenes" in res.stderr
