"""Tests for learner_jax/advantages.py against numpy, incl. groups of equal rewards."""

import jax.numpy as jnp
import numpy as np
import pytest

from learner_jax import advantages


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
