"""Tests for learner_jax/training/advantages.py against numpy, incl. groups of equal rewards.

The property tests compare float32 results with a float64 numpy reference on the same
float32 rewards, within tolerances that follow from the arithmetic: the estimators sum the
n values r - r_0 (magnitude: the group's spread), so each advantage carries a rounding of
about n * eps32 * spread, divided by (std + eps) under GRPO.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from learner_jax.training import advantages

EPS32 = float(np.finfo(np.float32).eps)
# XLA on CPU flushes float32 subnormals to zero (as GPUs may): a value below this is 0
# to the learner, so the estimators' arithmetic is only specified above it.
TINY32 = float(np.finfo(np.float32).tiny)
ESTIMATORS = ("grpo", "dr_grpo")
# Room over the n * eps32 * spread rounding of a mean (a few more roundings per element:
# the shift, the centring, the square root); a lost shift or a wrong formula is off by far
# more than this.
ROUNDINGS = 4
SETTINGS = settings(max_examples=150, deadline=None)  # deadline: first calls compile
# Group sizes come from a fixed set: each new n compiles every op of the estimators again,
# which was most of these tests' time with n drawn from 1..64 (64 shapes). The set keeps
# what the arithmetic distinguishes: a single sample, the powers of two the configs use,
# their odd neighbours (sums that do not halve evenly) and the largest group.
GROUP_SIZES = st.sampled_from((1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64))


def rewards(seed, g=6, n=5):
    rng = np.random.default_rng(seed)
    r = rng.normal(size=(g, n))
    r[1] = 0.7  # equal rewards: advantage 0, filtered by DAPO
    r[3] = rng.integers(0, 2, size=n)
    r[3, 0] = 1 - r[3, 1]  # a binary group that is not all equal
    return r


def test_registry():
    assert advantages.available_advantages() == ["dr_grpo", "grpo"]
    with pytest.raises(KeyError, match="unknown advantage"):
        advantages.get_advantage("rloo2")
    with pytest.raises(ValueError, match="already registered"):
        advantages.register_advantage("grpo")(lambda r: r)


@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_and_dr_grpo_match_numpy(seed):
    r = rewards(seed)
    mean = r.mean(1, keepdims=True)
    std = np.sqrt(((r - mean) ** 2).mean(1, keepdims=True))
    got = np.asarray(advantages.get_advantage("grpo")(jnp.asarray(r, jnp.float32), eps=1e-6))
    np.testing.assert_allclose(got, (r - mean) / (std + 1e-6), atol=1e-5)
    got = np.asarray(advantages.get_advantage("dr_grpo")(jnp.asarray(r, jnp.float32)))
    np.testing.assert_allclose(got, r - mean, atol=1e-6)
    # Equal-reward groups carry no signal under either estimator.
    for name in ("grpo", "dr_grpo"):
        np.testing.assert_array_equal(np.asarray(advantages.get_advantage(name)(r))[1], 0.0)


def test_group_filter_and_compute_advantages():
    r = rewards(2)
    keep = np.asarray(advantages.group_filter(r))
    np.testing.assert_array_equal(keep, r.max(1) > r.min(1))
    assert not keep[1] and keep[3]
    adv, seq_mask = advantages.compute_advantages(
        r, advantages.AdvantageConfig("grpo", filter_equal_groups=True)
    )
    g, n = r.shape
    assert adv.shape == (g * n,) and seq_mask.shape == (g * n,)
    np.testing.assert_array_equal(np.asarray(seq_mask), np.repeat(keep, n).astype(np.float32))
    np.testing.assert_allclose(
        np.asarray(adv).reshape(g, n), np.asarray(advantages.grpo_advantages(r)), atol=0
    )
    _, no_filter = advantages.compute_advantages(r, advantages.AdvantageConfig("dr_grpo"))
    np.testing.assert_array_equal(np.asarray(no_filter), 1.0)


def test_integer_rewards_and_single_sample_groups():
    r = np.array([[1, 0, 1, 1], [0, 0, 0, 0]], dtype=np.int32)
    adv = np.asarray(advantages.grpo_advantages(r))
    assert adv.dtype == np.float32
    np.testing.assert_allclose(adv[0], (r[0] - 0.75) / (np.sqrt(0.1875) + 1e-6), atol=1e-6)
    np.testing.assert_array_equal(adv[1], 0.0)
    # n = 1: the population std is 0, so the advantage is 0 (ddof=1 would give NaN).
    np.testing.assert_array_equal(np.asarray(advantages.grpo_advantages(np.ones((3, 1)))), 0.0)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match=r"\[G, n\]"):
        advantages.grpo_advantages(np.ones(4))
    with pytest.raises(KeyError, match="unknown advantage"):
        advantages.AdvantageConfig("nope")
    with pytest.raises(ValueError, match=">= 0"):
        advantages.AdvantageConfig("grpo", eps=-1.0)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_equal_float32_rewards_give_exactly_zero_advantages(name):
    """32 samples all rewarded 0.96: float32's mean is off by a few ulps, and GRPO used to
    divide that rounding by (std + 1e-6) into |A| ~ 0.3 per sample."""
    r = np.full((2, 32), 0.96, np.float32)
    r[1] = [0.0, 1.0] * 16
    adv = np.asarray(advantages.get_advantage(name)(r))
    np.testing.assert_array_equal(adv[0], 0.0)
    assert np.abs(adv[1]).min() > 0.4  # the informative group is untouched
    np.testing.assert_array_equal(np.asarray(advantages.group_filter(r)), [False, True])
    _, seq_mask = advantages.compute_advantages(
        r, advantages.AdvantageConfig(name, filter_equal_groups=True)
    )
    np.testing.assert_array_equal(np.asarray(seq_mask), np.repeat([0.0, 1.0], 32))


def _group(values, n):
    return np.asarray(values, np.float32).reshape(1, n)


@SETTINGS
@given(
    value=st.floats(width=32, allow_nan=False, allow_infinity=False),
    n=GROUP_SIZES,
)
def test_any_group_of_equal_float32_rewards_has_zero_advantage(value, n):
    r = _group([value] * n, n)
    for name in ESTIMATORS:
        np.testing.assert_array_equal(np.asarray(advantages.get_advantage(name)(r)), 0.0)
    assert not bool(advantages.group_filter(r)[0])


@SETTINGS
@given(
    value=st.floats(2.0**-100, 2.0**100, width=32) | st.floats(-(2.0**100), -(2.0**-100), width=32),
    n=GROUP_SIZES.filter(lambda n: n >= 2),
    data=st.data(),
)
def test_rewards_within_rounding_of_each_other_have_zero_advantage(value, n, data):
    """Rewards a few ulps apart (two roundings of the same reward) are equal: n values
    within n/2 ulps of each other spread at most n/2 * eps32 * |r|, inside the tolerance."""
    ulps = data.draw(st.lists(st.integers(0, n // 2), min_size=n, max_size=n))
    r = np.float32(value)
    values = []
    for k in ulps:
        v = r
        for _ in range(k):
            v = np.nextafter(v, np.float32(np.inf))
        values.append(v)
    g = _group(values, n)
    for name in ESTIMATORS:
        np.testing.assert_array_equal(np.asarray(advantages.get_advantage(name)(g)), 0.0)
    assert not bool(advantages.group_filter(g)[0])


def _reference(r64, eps=1e-6):
    """float64 numpy GRPO / Dr. GRPO (population std) of one group."""
    c = r64 - r64.mean()
    std = np.sqrt((c * c).mean())
    return {"grpo": c / (std + eps), "dr_grpo": c}, std


@SETTINGS
@given(
    magnitude=st.floats(2.0**-40, 2.0**40),
    offset=st.floats(-1e3, 1e3),
    units=GROUP_SIZES.filter(lambda n: n >= 2).flatmap(
        lambda n: st.lists(st.floats(-1.0, 1.0), min_size=n, max_size=n)
    ),
)
def test_informative_groups_match_float64_reference(magnitude, offset, units):
    """Rewards magnitude * (offset + u): any scale, centred anywhere (a large offset is the
    case a mean without the shift by r_0 gets wrong), against float64 numpy."""
    n = len(units)
    r = _group([magnitude * (offset + u) for u in units], n)
    r64 = r.astype(np.float64)[0]
    spread = r64.max() - r64.min()
    tol = n * EPS32 * np.abs(r64).max()
    assume(spread > 2 * tol)  # clearly informative; the boundary itself is float noise
    # The roundings below are of the spread's scale: flushing a subnormal (up to TINY32)
    # must be smaller than them (rewards 0 and 1e-42 are equal to the learner).
    assume(EPS32 * spread >= TINY32)
    want, std = _reference(r64)
    assert bool(advantages.group_filter(r)[0])
    rounding = ROUNDINGS * n * EPS32 * spread
    got = np.asarray(advantages.dr_grpo_advantages(r), np.float64)[0]
    np.testing.assert_allclose(got, want["dr_grpo"], rtol=0, atol=rounding)
    # GRPO: A = c / (s + eps) moves by (dc + |A| ds) / (s + eps) when c and s move by dc, ds.
    got = np.asarray(advantages.grpo_advantages(r), np.float64)[0]
    atol = rounding * (1 + np.abs(want["grpo"])) / (std + 1e-6)
    assert np.all(np.abs(got - want["grpo"]) <= atol), (got, want["grpo"], atol)


@SETTINGS
@given(
    units=GROUP_SIZES.flatmap(
        lambda n: st.lists(st.sampled_from([0.0, 0.25, 0.96, 1.0]), min_size=n, max_size=n)
    ),
    scale=st.sampled_from([1.0, 1e-3, 7.0, 1e4]),
)
def test_group_filter_keeps_exactly_the_groups_with_nonzero_advantages(units, scale):
    r = _group([scale * u for u in units], len(units))
    keep = bool(advantages.group_filter(r)[0])
    for name in ESTIMATORS:
        assert keep == bool(np.any(np.asarray(advantages.get_advantage(name)(r)) != 0)), name


def test_each_group_is_judged_on_its_own_rewards():
    """The tolerance and the spread are per group: a large group beside a small one does not
    make the small one equal, nor an equal group informative. And atol is exclusive."""
    r = np.array([[1e-3, 2e-3], [1e6, 1e6], [5.0, 5.0], [0.0, 1.0]], np.float32)
    assert np.asarray(advantages.informative(r)).tolist() == [True, False, False, True]
    assert np.asarray(advantages.group_filter(r, atol=1.0)).tolist() == [False] * 4
    assert np.asarray(advantages.group_filter(r, atol=0.5)).tolist() == [False, False, False, True]
