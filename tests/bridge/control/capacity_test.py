"""The capacity model's formulas on hand-worked cases (derivation in bridge/control/capacity.py)."""

import pytest

from bridge.control import capacity


def test_requirement_is_rollouts_per_step_over_step_time():
    assert capacity.required_rollouts_per_s(256, 0.5) == pytest.approx(512.0)
    with pytest.raises(ValueError):
        capacity.required_rollouts_per_s(256, 0.0)


@pytest.mark.parametrize(
    "kappa, step_s, latency_s, want",
    [(1, 1.0, 0.0, 1), (1, 1.0, 0.5, 2), (1, 1.0, 2.0, 3), (2, 1.0, 2.0, 4), (3, 0.5, 0.2, 4)],
)
def test_min_staleness(kappa, step_s, latency_s, want):
    # kappa * T + latency <= S * T, worked by hand for each row.
    assert capacity.min_staleness(kappa, step_s, latency_s) == want


def test_utilization_rate_bound_and_freshness_stall():
    # Half the needed throughput: the learner trains half the time.
    assert capacity.predicted_utilization(5.0, 10.0, 1.0, 4, 1, 0.0) == pytest.approx(0.5)
    # Enough throughput, S one short: each update waits kappa*T + latency - S*T = 0.5 s.
    assert capacity.predicted_utilization(20.0, 10.0, 1.0, 1, 1, 0.5) == pytest.approx(1 / 1.5)
    r = capacity.report(5.0, 10.0, 1.0, staleness=1, publish_every=1, latency_s=0.5)
    assert not r.rate_ok and not r.fresh_ok and r.min_staleness == 2
    advice = r.advice(staleness=1)
    assert "add workers" in advice and "raise `staleness` to 2" in advice
    assert capacity.report(20.0, 10.0, 1.0, 2, 1, 0.5).advice(2) is None
