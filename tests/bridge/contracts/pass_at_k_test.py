"""The pass@k estimator against the closed form 1 - C(n-c, k)/C(n, k), in exact fractions,
and against brute force: the share of all k-subsets of the n samples holding a correct one."""

import itertools
import math
from fractions import Fraction

import pytest

from bridge.contracts.pass_at_k import mean_pass_at_k, parse_ks, pass_at_k


def closed_form(n, c, k):
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


@pytest.mark.parametrize("n", [1, 2, 5, 8, 16, 100])
def test_matches_the_closed_form_on_every_count(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            want = float(closed_form(n, c, k))
            assert abs(pass_at_k(n, c, k) - want) <= 4 * n * 2.0**-52, (n, c, k)


def test_matches_brute_force_over_subsets():
    n = 7
    for c in range(n + 1):
        correct = set(range(c))
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(range(n), k))
            hit = sum(1 for s in subsets if correct & set(s)) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(hit, abs=1e-12)


def test_known_values_and_mean():
    assert pass_at_k(8, 0, 8) == 0.0 and pass_at_k(8, 8, 1) == 1.0
    assert pass_at_k(8, 2, 1) == pytest.approx(0.25)  # pass@1 is the fraction correct
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert mean_pass_at_k([(4, 1), (4, 0)], 2) == pytest.approx(0.25)


def test_bad_arguments_are_refused():
    for n, c, k in [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)
    assert parse_ks("8,1,8", 8) == [1, 8]
    with pytest.raises(ValueError, match="k must be in 1..n=4"):
        parse_ks("1,8", 4)


def test_parse_ks_takes_a_sequence_of_ints_too():
    # The evaluator passes config lists as well as flag strings.
    assert parse_ks([8, 1, 8], 8) == [1, 8]
    assert parse_ks((2,), 4) == [2]
