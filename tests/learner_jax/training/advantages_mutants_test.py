"""learner_jax/training/advantages.py: what its first test file left open, found by mutation testing
(`make mutants MODULES=learner_jax/training/advantages.py`): the registry holds the estimator
itself, the config's eps and filter_atol reach the estimator and the filter, eps = 0 is allowed,
bool rewards work, and dtypes stay float32 also where jax's default float is float64."""

import jax.numpy as jnp
import numpy as np
from jax import enable_x64

from learner_jax.training import advantages


def test_registry_holds_the_decorated_functions():
    assert advantages.get_advantage("grpo") is advantages.grpo_advantages
    assert advantages.get_advantage("dr_grpo") is advantages.dr_grpo_advantages


def test_config_eps_and_atol_reach_the_estimator_and_the_filter():
    r = np.array([[0.0, 1.0, 1.0, 0.0], [0.5, 0.6, 0.5, 0.6], [2.0, 0.0, 1.0, 1.0]])
    g, n = r.shape
    cfg = advantages.AdvantageConfig("grpo", eps=1.0, filter_equal_groups=True, filter_atol=0.2)
    adv, seq_mask = advantages.compute_advantages(r, cfg)
    np.testing.assert_allclose(
        np.asarray(adv).reshape(g, n), np.asarray(advantages.grpo_advantages(r, eps=1.0)), atol=0
    )
    # Group 1 spreads 0.1 < atol: filtered; with atol 0 it would be kept.
    np.testing.assert_array_equal(np.asarray(seq_mask), np.repeat([1.0, 0.0, 1.0], n))


def test_eps_zero_is_allowed():
    cfg = advantages.AdvantageConfig("dr_grpo", eps=0.0)
    adv, _ = advantages.compute_advantages(np.array([[1.0, 3.0]]), cfg)
    np.testing.assert_array_equal(np.asarray(adv), [-1.0, 1.0])


def test_bool_rewards():
    r = np.array([[True, False, True, True], [False, False, False, False]])
    keep = np.asarray(advantages.group_filter(r))
    np.testing.assert_array_equal(keep, [True, False])
    np.testing.assert_allclose(
        np.asarray(advantages.dr_grpo_advantages(r)), r - r.mean(1, keepdims=True), atol=1e-7
    )


def test_dtypes_stay_float32_under_x64():
    r = np.array([[1, 0, 1, 1], [0, 0, 0, 0]], dtype=np.int32)
    with enable_x64():
        adv, seq_mask = advantages.compute_advantages(r, advantages.AdvantageConfig("grpo"))
        assert adv.dtype == jnp.float32 and seq_mask.dtype == jnp.float32
