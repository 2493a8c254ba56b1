"""Cost-aware activation vs brute force (exact optimum), hysteresis, and its solve time."""

import itertools
import time

import numpy as np
import pytest

from bridge.control.fleet.activation import Offer, decide


def brute_force(prices, mus, need):
    best = None
    for mask in itertools.product((0, 1), repeat=len(prices)):
        m = np.array(mask, bool)
        if mus[m].sum() >= need - 1e-9 and (best is None or prices[m].sum() < best):
            best = prices[m].sum()
    return best


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force_on_random_small_fleets(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 13))
    prices = np.round(rng.uniform(0.1, 3.0, n), 2)
    mus = np.round(rng.uniform(0.5, 20.0, n), 2)
    required = float(rng.uniform(0.1, 1.2) * mus.sum() / 1.1)
    offers = [Offer(f"w{i}", prices[i], mus[i]) for i in range(n)]
    d = decide(offers, required, margin=0.1)
    need = 1.1 * required
    optimum = brute_force(prices, mus, need)
    if optimum is None:  # the whole fleet falls short: everything runs, shortfall reported
        assert d.active == {o.worker_id for o in offers}
        assert d.standby == frozenset()
        assert d.shortfall_rollouts_per_s == pytest.approx(max(0.0, required - mus.sum()))
    else:
        assert d.price_per_hour == pytest.approx(optimum, abs=1e-9)
        assert d.active_rollouts_per_s >= need - 1e-6
        assert d.active | d.standby == {o.worker_id for o in offers}


def test_unmeasured_workers_stay_active_and_do_not_count():
    offers = [Offer("fast", 1.0, 10.0), Offer("cheap", 0.1, 2.0), Offer("new", 5.0, None)]
    d = decide(offers, required_rollouts_per_s=1.0, margin=0.0)
    assert d.active == {"cheap", "new"}
    assert d.active_rollouts_per_s == pytest.approx(2.0)


def test_hysteresis_keeps_a_set_that_still_covers_and_is_not_much_dearer():
    offers = [Offer("a", 1.00, 10.0), Offer("b", 0.95, 10.0)]
    d = decide(offers, 5.0, margin=0.1, previous={"a"})
    assert d.active == {"a"} and d.kept_previous  # 5% saving < min_saving 10%
    d = decide(offers, 5.0, margin=0.1, previous={"a"}, min_saving=0.01)
    assert d.active == {"b"} and not d.kept_previous
    # the kept set no longer covers the requirement: switch at once
    d = decide([Offer("a", 1.0, 4.0), Offer("b", 2.0, 10.0)], 5.0, previous={"a"})
    assert d.active == {"b"} and not d.kept_previous


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="negative"):
        decide([Offer("a", -1.0, 1.0)], 1.0)
    with pytest.raises(ValueError, match="margin"):
        decide([Offer("a", 1.0, 1.0)], 1.0, margin=-0.5)


def test_two_thousand_workers_solve_within_a_second_and_a_half_of_cpu():
    rng = np.random.default_rng(7)
    # Six GPU types with per-worker jitter in measured throughput, as in a real fleet.
    types = [(0.22, 3.0), (0.34, 5.0), (0.79, 9.0), (1.39, 16.0), (2.69, 30.0), (3.59, 36.0)]
    offers = []
    for i in range(2000):
        price, mu = types[i % len(types)]
        offers.append(Offer(f"w{i}", price, mu * rng.uniform(0.9, 1.1)))
    total = sum(o.rollouts_per_s for o in offers)
    times = []
    for frac in (0.1, 0.3, 0.6):
        # CPU seconds of this process (HiGHS runs in it): wall time on a shared 2-core box
        # measures the neighbours (1.0-1.4 s wall at load 17). Even CPU time inflates on an
        # overloaded host (0.90-1.15 s once, in a suite run at 1.6 times its usual CPU time,
        # against 0.55-0.72 s on the quiet box the same day), and interference only adds:
        # the best of three is the solve's cost. The bound catches a solve that stops
        # scaling (the 0/1 covering MILP going exponential), not the box's speed.
        best = float("inf")
        for _ in range(3):
            t0 = time.process_time()
            d = decide(offers, frac * total / 1.1, margin=0.1)
            best = min(best, time.process_time() - t0)
            assert d.active_rollouts_per_s >= frac * total - 1e-6
        times.append(best)
    print(f"2000-worker activation solve CPU times: {[round(t, 3) for t in times]} s")
    assert max(times) < 1.5, times
