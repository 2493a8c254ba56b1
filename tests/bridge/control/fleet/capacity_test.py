"""The capacity model's formulas on hand-worked cases (derivation in
bridge/control/fleet/capacity.py)."""

import pytest

from bridge.control.fleet import capacity


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


def test_min_staleness_with_the_broadcast_period():
    # kappa_eff = max(kappa, ceil(period / T)): a 2.5 s period at T = 1 s skips versions, so
    # S >= 3 + ceil(0.5) = 4; a period shorter than kappa * T changes nothing.
    assert capacity.min_staleness(1, 1.0, 0.5, broadcast_period_s=2.5) == 4
    assert capacity.min_staleness(2, 1.0, 0.5, broadcast_period_s=1.5) == 3
    assert capacity.min_staleness(1, 1.0, 0.5, broadcast_period_s=0.0) == 2


def test_utilization_rate_bound_and_freshness_stall():
    # Half the needed throughput: the learner trains half the time (rho = 5 * 1 / 10).
    assert capacity.predicted_utilization(5.0, 10.0, 1.0, 4, 1, 0.0) == pytest.approx(0.5)
    # S one short of min S = 2, but rho = 2: the first R rollouts of a version are back
    # L + T / rho = 1 s after it is published, within (S + 1 - kappa) * T = 1 s: no stall.
    # (The old form, a stall of kappa T + L - S T = 0.5 s per update, said 1 / 1.5; the
    # simulation sides with the new one: an overprovisioned fleet needs only its first R.)
    assert capacity.predicted_utilization(20.0, 10.0, 1.0, 1, 1, 0.5) == pytest.approx(1.0)
    # Exactly provisioned (rho = 1), kappa = 1, S = 2, L = 2 T: (S + 1 - kappa) T +
    # (S + 1) X = L + T / rho -> 2 + 3 X = 3, X = 1/3; utilization 1 / (1 + 1/3) = 0.75
    # (simulated 0.773, bench/plan_sweep.py's freshness fleet; the old form said 0.50).
    assert capacity.predicted_utilization(10.0, 10.0, 1.0, 2, 1, 2.0) == pytest.approx(0.75)
    # kappa = 2, S = 3, L = 2 T, rho = 1: 2 + floor(4 / 2) X = 3, X = 0.5; 2 / 2.5 = 0.8
    # (simulated 0.818). With 25% spare (rho = 1.25): 2 + 2 X = 2.8, X = 0.4; 2 / 2.4.
    assert capacity.predicted_utilization(10.0, 10.0, 1.0, 3, 2, 2.0) == pytest.approx(0.8)
    assert capacity.predicted_utilization(12.5, 10.0, 1.0, 3, 2, 2.0) == pytest.approx(2 / 2.4)
    # Rate and freshness both short (rho = 0.5, S = 2, L = 2 T): 2 + 3 X = 2 + 2, X = 2/3,
    # freshness 0.6; the lower bound, rho = 0.5, wins.
    assert capacity.predicted_utilization(5.0, 10.0, 1.0, 2, 1, 2.0) == pytest.approx(0.5)
    # A broadcast period of 2 T at kappa = 1 acts as kappa_eff = 2: S = 3, L = 2 T -> 0.8.
    assert capacity.predicted_utilization(
        10.0, 10.0, 1.0, 3, 1, 2.0, broadcast_period_s=2.0
    ) == pytest.approx(0.8)
    r = capacity.report(5.0, 10.0, 1.0, staleness=1, publish_every=1, latency_s=0.5)
    assert not r.rate_ok and not r.fresh_ok and r.min_staleness == 2
    advice = r.advice(staleness=1)
    assert "add workers" in advice and "raise `staleness` to 2" in advice
    assert capacity.report(20.0, 10.0, 1.0, 2, 1, 0.5).advice(2) is None


def test_spare_throughput_counts_as_fresh_although_s_is_below_min_s():
    # S = 2, kappa = 1, T = 2 s, latency 2.5 s: min S = 1 + ceil(1.25) = 3. With rho = 4 the
    # first R rollouts of a version are back 2.5 + 0.5 = 3 s after it, within (S + 1 - kappa)
    # T = 4 s: no stall, no warning. Exactly provisioned (rho = 1): 2.5 + 2 > 4, a stall.
    spare = capacity.report(512.0, 256, 2.0, 2, 1, 2.5)
    assert spare.min_staleness == 3 and spare.fresh_ok and spare.advice(2) is None
    exact = capacity.report(128.0, 256, 2.0, 2, 1, 2.5)
    assert not exact.fresh_ok and exact.predicted_utilization < 1.0


def test_warm_samples_leave_out_the_cold_ones_and_take_the_median():
    s = capacity.WarmSamples(cold=2, keep=3)
    assert s.estimate() is None
    assert not s.add(30.0) and not s.add(20.0)  # the first two: engine start, compile
    assert len(s) == 0 and s.estimate() == 20.0  # no warm one yet: the last cold stands in
    assert not s.add(9.0, cold=True)  # flagged cold (a lease that spanned a swap)
    assert all(s.add(x) for x in (1.0, 1.2, 50.0))
    assert len(s) == 3 and s.estimate() == 1.2  # one slow warm sample does not move it
    s.add(1.1)
    assert list(s.warm) == [1.2, 50.0, 1.1]  # the last `keep`


def test_arrival_of_the_first_rollouts_from_an_unequal_fleet():
    # One worker: its delay plus R / mu, the L + T / rho of the closed form.
    assert capacity.arrival_s([(1.0, 100.0)], 256) == pytest.approx(1.0 + 2.56)
    # A fast worker (0.35 s, 500/s) brings 256 back at 0.862 s, before the throttled one
    # (1.0 s, 150/s) returns anything: the slow one does not delay the first R.
    assert capacity.arrival_s([(1.0, 150.0), (0.35, 500.0)], 256) == pytest.approx(0.862)
    # Both needed: 500 * (tau - 0.35) + 150 * (tau - 1.0) = 512 -> tau = 837 / 650
    assert capacity.arrival_s([(1.0, 150.0), (0.35, 500.0)], 512) == pytest.approx(837 / 650)
    assert capacity.arrival_s([(1.0, 0.0)], 1) == float("inf")
    # The prediction with it: the run it came from measured 0.65 (rho 0.65, T 0.25 s).
    slowest = capacity.predicted_utilization(650.0, 256, 0.25, 2, 1, 1.0)
    first = capacity.arrival_s([(1.0, 150.0), (0.35, 500.0)], 256)
    fleet = capacity.predicted_utilization(650.0, 256, 0.25, 2, 1, 1.0, first_rollouts_s=first)
    assert slowest < 0.5 and fleet == pytest.approx(650.0 * 0.25 / 256)
