"""Tests for learner_jax/training/optim.py: the schedule and AdamW steps against numpy formulas."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from learner_jax.training import optim


def np_lr(k, cfg):
    peak, w, total = cfg.learning_rate, cfg.warmup_steps, cfg.total_steps
    if k < w:
        return peak * k / w
    t = min(k - w, total - w) / (total - w)
    f = cfg.end_lr_fraction
    return peak * (f + (1 - f) * 0.5 * (1 + math.cos(math.pi * t)))


@pytest.mark.parametrize("warmup", [0, 10])
def test_schedule_matches_formula(warmup):
    cfg = optim.OptimizerConfig(
        learning_rate=3e-4, warmup_steps=warmup, total_steps=100, end_lr_fraction=0.1
    )
    sched = optim.make_schedule(cfg)
    for k in [0, 1, 5, 9, 10, 11, 50, 99, 100, 150]:
        assert float(sched(k)) == pytest.approx(np_lr(k, cfg), rel=1e-5, abs=1e-12), k
    assert float(sched(warmup)) == pytest.approx(3e-4)
    assert float(sched(1000)) == pytest.approx(3e-5)


def np_adamw(params, grads_seq, cfg):
    """Reference: global-norm clip, Adam moments with bias correction, decoupled decay."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    mu = {k: np.zeros_like(v) for k, v in p.items()}
    nu = {k: np.zeros_like(v) for k, v in p.items()}
    for step, grads in enumerate(grads_seq):
        g = {k: v.astype(np.float64) for k, v in grads.items()}
        norm = math.sqrt(sum(float((v**2).sum()) for v in g.values()))
        if norm > cfg.max_grad_norm:
            g = {k: v * cfg.max_grad_norm / norm for k, v in g.items()}
        lr = np_lr(step, cfg)
        for k in p:
            mu[k] = cfg.b1 * mu[k] + (1 - cfg.b1) * g[k]
            nu[k] = cfg.b2 * nu[k] + (1 - cfg.b2) * g[k] ** 2
            m_hat = mu[k] / (1 - cfg.b1 ** (step + 1))
            v_hat = nu[k] / (1 - cfg.b2 ** (step + 1))
            p[k] = p[k] - lr * (m_hat / (np.sqrt(v_hat) + cfg.eps) + cfg.weight_decay * p[k])
    return p


def test_adamw_steps_match_numpy():
    cfg = optim.OptimizerConfig(
        learning_rate=1e-2,
        warmup_steps=2,
        total_steps=6,
        end_lr_fraction=0.2,
        b1=0.8,
        b2=0.95,
        eps=1e-6,
        weight_decay=0.1,
        max_grad_norm=1.0,
    )
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(4, 3)), "b": rng.normal(size=(3,))}
    params = {k: v.astype(np.float32) for k, v in params.items()}
    # Step scales alternate, so some steps are clipped (norm > 1) and some are not.
    grads_seq = [
        {k: (rng.normal(size=v.shape) * s).astype(np.float32) for k, v in params.items()}
        for s in (2.0, 0.05, 3.0, 0.1, 1.5, 0.02)
    ]
    norms = [math.sqrt(sum(float((v**2).sum()) for v in g.values())) for g in grads_seq]
    assert any(n > 1 for n in norms) and any(n < 1 for n in norms)

    tx = optim.make_optimizer(cfg)
    state = tx.init(jax.tree.map(jnp.asarray, params))
    p = jax.tree.map(jnp.asarray, params)

    @jax.jit
    def step(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    for g in grads_seq:
        p, state = step(p, state, jax.tree.map(jnp.asarray, g))
    want = np_adamw(params, grads_seq, cfg)
    for k in params:
        np.testing.assert_allclose(np.asarray(p[k]), want[k], atol=1e-6, rtol=1e-5)
    moved = max(float(np.abs(np.asarray(p[k]) - params[k]).max()) for k in params)
    assert moved > 1e-3  # the comparison is not between unchanged parameters


def test_no_clipping_when_disabled_and_decay_mask():
    cfg = optim.OptimizerConfig(
        learning_rate=0.1, total_steps=10, max_grad_norm=0.0, weight_decay=0.5
    )
    params = {"w": jnp.ones((2,)), "norm": jnp.ones((2,))}
    tx = optim.make_optimizer(cfg, weight_decay_mask={"w": True, "norm": False})
    grads = {"w": jnp.zeros((2,)), "norm": jnp.zeros((2,))}
    upd, _ = tx.update(grads, tx.init(params), params)
    # Zero gradient: only decay moves "w" (lr(0) = peak without warmup); "norm" is exempt.
    np.testing.assert_allclose(np.asarray(upd["w"]), -0.1 * 0.5, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(upd["norm"]), 0.0)


def test_bad_config_raises():
    with pytest.raises(ValueError, match="total_steps"):
        optim.OptimizerConfig(warmup_steps=10, total_steps=10)
    with pytest.raises(ValueError, match="end_lr_fraction"):
        optim.OptimizerConfig(end_lr_fraction=1.5)
    with pytest.raises(ValueError, match="learning_rate"):
        optim.OptimizerConfig(learning_rate=-1.0)
