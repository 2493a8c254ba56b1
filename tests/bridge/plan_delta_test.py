"""The planner prices delta versions: an 8B bf16 policy on 100 Mb/s workers.

A full version is 16 GB: 1280 s per hop at 12.5 MB/s, so no useful staleness holds. With
deltas (the run's measured `bridge/version_bytes`, ~4% of full at lr 1e-6, bench.delta) a
version moves 640 MB per link; only a restarted worker still fetches the whole model.
"""

import pytest

from bridge.plan import fleet as fleet_lib
from bridge.plan import from_run, links, planner

MODEL = 16e9  # Qwen3-8B in bf16
MB_S = 100 / 8  # 100 Mb/s


def _fleet(**top):
    raw = {
        "learner": {"step_s": 120.0, "rollouts_per_step": 256, "publish_s": 30.0,
                    "price_per_hour": 20.0},
        "model_bytes": MODEL,
        "staleness": 4,
        "publish_every": 1,
        "steps": 20,
        "group_size": 8,
        "margin": 0.2,
        "broadcast": "chain",
        "workers": [{"name": "cheap", "count": 40, "price_per_hour": 0.4,
                     "rollouts_per_s": 0.1, "bandwidth_mb_s": MB_S}],
    }  # fmt: skip
    raw.update(top)
    return fleet_lib.parse(raw)


def test_plan_for_8b_on_100mbps_is_priced_with_delta_bytes():
    full, delta = _fleet(), _fleet(version_bytes=0.04 * MODEL)
    assert full.wire_bytes == MODEL and delta.wire_bytes == pytest.approx(0.04 * MODEL)
    p_full, p_delta = planner.plan(full), planner.plan(delta)
    one_hop = MODEL / 1e6 / MB_S  # 1280 s: the chain's pipelined delay ~ one hop
    assert p_full["broadcast_s"] >= one_hop
    # The chain's per-hop chunk latency does not shrink with the version: not a flat 4%.
    assert p_delta["broadcast_s"] < p_full["broadcast_s"] / 5
    assert p_delta["broadcast_period_s"] < p_full["broadcast_period_s"] / 5
    assert p_delta["latency_s"] < p_full["latency_s"] / 4
    # Full versions overrun S = 4 steps of 120 s: the learner stalls; deltas keep it busy.
    assert p_full["predicted_utilization"] < 0.5
    assert p_delta["predicted_utilization"] > 0.9
    # A restarted worker still fetches the whole model (availability is not delta-priced).
    w = delta.workers[0]
    restart_fetch = links.single_fetch_s(
        "chain", MODEL, w.bandwidth_mb_s, delta.learner.uplink_mb_s
    )
    assert restart_fetch == pytest.approx(one_hop)


def test_version_bytes_come_from_the_runs_metrics():
    rows = [{"bridge/version_bytes": b} for b in (5e6, 7e6, 6e6)] + [{"step": 9}]
    assert from_run._version_bytes(rows) == {"version_bytes": 6e6}
    assert from_run._version_bytes([{"step": 1}]) == {}
    with pytest.raises(fleet_lib.FleetError, match="version_bytes"):
        _fleet(version_bytes=0)
