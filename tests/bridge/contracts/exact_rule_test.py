"""The exact check's rule at its edges (bridge/contracts/exact_check.py)."""

import numpy as np
from scipy import stats

from bridge.contracts import exact_check as ec


def test_margins_by_declared_engine():
    assert ec.margins_for("float32", 0.5, 0.5) == ec.FP32_MARGIN
    assert ec.margins_for("bfloat16", 0.5, 0.25) == (0.5, 0.25)
    assert ec.margins_for("float16") == (ec.MARGIN_ABS, ec.MARGIN_REL)
    assert ec.margin(np.array([0, 10]), 0.02, 0.08).tolist() == [0.02, 0.02 + 0.8]


def test_a_gap_at_the_margin_passes_and_at_the_flip_gap_is_no_flip():
    scales = np.array([[0.0, 0.0, 0.0]])
    gaps = np.array([[0.1, ec.FLIP_GAP, 0.1 + 1e-9]])
    bad, flips = ec.classify(gaps, scales, np.ones((1, 3)), 0.1, 0.0)
    assert bad.tolist() == [1] and flips.tolist() == [1]  # 0.1 is a flip, FLIP_GAP is not


def test_one_mismatch_quarantines_at_a_threshold_of_one():
    assert ec.quarantines(1, 1, tokens=1, fraction=0.0)
    assert not ec.quarantines(0, 1, tokens=1, fraction=0.0)


def test_false_quarantine_bound_is_the_worst_binomial_tail():
    rate, tokens, fraction = 0.02, 8, 0.05
    brute = max(
        stats.binom.sf(max(tokens, int(np.ceil(fraction * n))) - 1, n, rate)
        for n in range(tokens, 2000)
    )
    bound = ec.false_quarantine_bound(rate, tokens, fraction)
    assert bound >= brute * 0.999  # the grid reaches the worst n (near tokens / fraction)
    assert bound <= brute * 1.001


def _brute_bound(rate, tokens, fraction, n_max):
    n = np.arange(tokens, n_max)
    need = np.maximum(tokens, np.ceil(fraction * n)).astype(np.int64)
    return float(stats.binom.sf(need - 1, n, rate).max())


def test_the_bound_finds_a_peak_far_past_a_hundred_times_the_count():
    # tokens / fraction = 1,600: the worst n lies where the share rule takes over, and the
    # tail's peaks sit on exact multiples of 1 / fraction, which a coarse grid steps over.
    rate, tokens, fraction = 0.002, 8, 0.005
    brute = _brute_bound(rate, tokens, fraction, 20_000)
    assert abs(ec.false_quarantine_bound(rate, tokens, fraction) - brute) <= 1e-3 * brute


def test_a_rate_above_the_share_is_quarantined_almost_surely_in_the_long_run():
    # Honest mismatches at 1.2% against a 1% share: the count's mean outgrows the share, so
    # the chance reaches 1 only over many tokens (at n = 16,000 it is still ~0.99).
    assert ec.false_quarantine_bound(0.012, 8, 0.01) > 1 - 1e-6


def test_without_a_share_any_rate_reaches_the_count():
    assert ec.false_quarantine_bound(1e-6, 8, 0.0) > 0.99  # a billion tokens: mean 1,000


def test_margins_are_float64_for_float32_scales():
    # The learner's logits are float32: the margin must not be rounded to float32, or a gap
    # exactly at the float64 margin would count as a mismatch.
    scales = np.array([[3.3, 7.7, 11.1]], np.float32)
    assert ec.margin(scales).dtype == np.float64
    gaps = ec.MARGIN_ABS + ec.MARGIN_REL * scales.astype(np.float64)
    bad, _ = ec.classify(gaps, scales, np.ones((1, 3)))
    assert bad.tolist() == [0]
