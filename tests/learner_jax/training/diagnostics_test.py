"""Tests for learner_jax/training/diagnostics.py: each number against a direct computation."""

import jax.numpy as jnp
import numpy as np
import pytest

from learner_jax.training import advantages, diagnostics


def test_group_stats():
    rewards = np.array([[1.0, 1.0, 1.0, 1.0], [-2.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    adv, _ = advantages.compute_advantages(jnp.asarray(rewards), advantages.AdvantageConfig("grpo"))
    got = diagnostics.group_stats(rewards, np.asarray(adv))
    assert got["adv/zero_groups_frac"] == pytest.approx(2 / 3)
    assert got["adv/group_std_mean"] == pytest.approx(np.sqrt(27 / 16) / 3)
    # One outlier among four: |A| = 3 / sqrt(3) = sqrt(3) (population std, as GRPO).
    assert got["adv/abs_max"] == pytest.approx(np.sqrt(3), rel=1e-5)
    # Equal within float32 rounding (32 rewards of 0.96, one a ulp above) is a zero group.
    r32 = np.full((2, 32), 0.96, np.float32)
    r32[0, 0] = np.nextafter(r32[0, 0], np.float32(1.0))
    r32[1, 0] = 0.0
    adv, _ = advantages.compute_advantages(r32, advantages.AdvantageConfig("grpo"))
    got = diagnostics.group_stats(r32, np.asarray(adv))
    assert got["adv/zero_groups_frac"] == 0.5


def test_policy_stats():
    logits = np.array([[2.0, 0.0, -1.0, 5.0], [0.0, 0.0, 0.0, 0.0]])
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    got = diagnostics.policy_stats(logp, legal_ids=[0, 1])
    p = np.exp(logp)
    assert got["eval/legal_mass"] == pytest.approx(((p[0, 0] + p[0, 1]) + 0.5) / 2)
    h = [-(p[i] * np.log(p[i])).sum() for i in range(2)]
    assert got["eval/next_token_entropy"] == pytest.approx(np.mean(h))
    assert got["eval/logit_std"] == pytest.approx(np.std(logits[0]) / 2)  # shift-free


def test_grad_norms_by_layer():
    grads = {"embed": {"w": jnp.array([3.0, 4.0])}, "layers_0": {"a": jnp.ones((2, 2))}}
    got = diagnostics.grad_norms_by_layer(grads)
    assert float(got["grad_norm/embed"]) == pytest.approx(5.0)
    assert float(got["grad_norm/layers_0"]) == pytest.approx(2.0)


def test_cold_adam_warning(caplog):
    """High rate without warmup warns (the measured Kuhn collapse); warmup or 3e-4 do not."""
    assert diagnostics.cold_adam_warning(1e-3, 0) is not None
    assert "warmup_steps >= 10" in diagnostics.cold_adam_warning(5e-4, 5)
    assert diagnostics.cold_adam_warning(1e-3, 10) is None
    assert diagnostics.cold_adam_warning(3e-4, 0) is None
    with caplog.at_level("WARNING"):
        diagnostics.warn_cold_adam(1e-3, 0)
    assert "sign steps" in caplog.text


def test_first_adam_step_is_a_sign_step():
    """Why: Adam's first update is lr * sign(g) for any gradient size, so a gradient of
    1e-6 (an unsampled token's embedding row) moves as far as one of 1 (eps is 1e-8)."""
    import optax

    g = {"big": jnp.array([1.0, -2.0]), "tiny": jnp.array([1e-6, -3e-6])}
    opt = optax.adam(1e-3)
    upd, _ = opt.update(g, opt.init(g))
    np.testing.assert_allclose(np.abs(np.asarray(upd["tiny"])), 1e-3, rtol=0.02)
    np.testing.assert_allclose(np.abs(np.asarray(upd["big"])), 1e-3, rtol=1e-4)
