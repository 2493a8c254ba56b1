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
