"""Tests for learner_jax/training/losses.py.

Every loss is checked against an independent float64 numpy implementation (a per-token
loop with hand-derived gradients, itself checked by finite differences) on random inputs
with padded tokens, an empty sequence and groups of equal rewards. A stale-rollout bandit
shows that the decoupled-PPO correction keeps learning where plain PPO against the stale
behavior policy regresses.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from float_tolerance import assert_close_at_scale

from learner_jax.training import advantages, losses

G, N, T = 8, 3, 9  # groups, samples per group, padded completion length
B = G * N

# ------------------------------------------------------------------ numpy reference


def np_grpo_adv(rewards):
    r = np.asarray(rewards, np.float64)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-6)).reshape(-1)


def np_weight(w, mode, cap):
    """One off-policy weight from its raw ratio w (module docstring of losses.py)."""
    if mode in ("tis", "geo_seq"):
        return min(w, cap)
    if mode == "mask":
        return w if w <= cap else 0.0
    if mode in ("token_mis", "seq_mis"):
        return w if 1.0 / cap <= w <= cap else 0.0
    assert mode == "none"
    return 1.0


def np_token_weights(prox, behav, m, cfg):
    """W [B, T] of the token-level losses, token by token or sequence by sequence."""
    mode, cap = cfg.correction, cfg.is_cap
    w = np.zeros_like(prox)
    for b in range(prox.shape[0]):
        toks = [t for t in range(prox.shape[1]) if m[b, t]]
        if mode in ("seq_mis", "geo_seq"):
            log_rho = sum(prox[b, t] - behav[b, t] for t in toks)
            log_seq = log_rho / max(len(toks), 1) if mode == "geo_seq" else log_rho
            for t in toks:
                w[b, t] = np_weight(np.exp(log_seq), mode, cap)
        else:
            for t in toks:
                w[b, t] = np_weight(np.exp(prox[b, t] - behav[b, t]), mode, cap)
    return w


def np_surrogate(r, a, cfg):
    """-min(r a, clip(r) a) and its derivative w.r.t. r."""
    c = min(max(r, 1 - cfg.clip_eps), 1 + cfg.eps_high)
    if c * a < r * a:  # clipped branch active: flat in r
        return -c * a, 0.0
    return -r * a, -a


def np_loss(logp, inp, cfg):
    """(loss, dloss/dlogp) in float64, written out token by token."""
    logp, prox, behav = (
        np.asarray(x, np.float64) for x in (logp, inp.prox_logp, inp.behavior_logp)
    )
    adv = np.asarray(inp.advantages, np.float64)
    m = np.asarray(inp.loss_mask, np.float64)
    if inp.seq_mask is not None:
        m = m * np.asarray(inp.seq_mask, np.float64)[:, None]
    ref = None if inp.ref_logp is None else np.asarray(inp.ref_logp, np.float64)
    beta = cfg.kl_coef
    nb, nt = logp.shape
    n = m.sum(1)
    k_seqs = max((n > 0).sum(), 1)
    loss, grad = 0.0, np.zeros_like(logp)
    if cfg.name == "gspo":
        for b in range(nb):
            if n[b] == 0:
                continue
            toks = [t for t in range(nt) if m[b, t]]
            s = np.exp(sum(logp[b, t] - prox[b, t] for t in toks) / n[b])
            log_rho = sum(prox[b, t] - behav[b, t] for t in toks)
            mode = cfg.correction
            if mode == "seq_mis":  # the sequence's full likelihood ratio
                w = np_weight(np.exp(log_rho), mode, cfg.is_cap)
            else:  # GSPO's geometric mean; 'geo_seq' truncates it like 'tis'
                mode = "tis" if mode == "geo_seq" else mode
                w = np_weight(np.exp(log_rho / n[b]), mode, cfg.is_cap)
            pg, dpg = np_surrogate(s, adv[b], cfg)
            loss += w * pg / k_seqs
            for t in toks:
                grad[b, t] += w * dpg * s / n[b] / k_seqs  # ds/dlogp_bt = s / n_b
                if ref is not None and beta > 0:
                    d = ref[b, t] - logp[b, t]
                    loss += beta * (np.exp(d) - d - 1) / n[b] / k_seqs
                    grad[b, t] += beta * (1 - np.exp(d)) / n[b] / k_seqs
        return loss, grad
    weights = np_token_weights(prox, behav, m, cfg)
    for b in range(nb):
        for t in range(nt):
            if not m[b, t]:
                continue
            if cfg.name == "grpo":
                coef = 1.0 / (n[b] * k_seqs)
            elif cfg.name == "dr_grpo":
                const = nt if cfg.dr_grpo_constant is None else cfg.dr_grpo_constant
                coef = 1.0 / (const * k_seqs)
            else:  # dapo
                coef = 1.0 / m.sum()
            r = np.exp(logp[b, t] - prox[b, t])
            w = weights[b, t]
            pg, dpg = np_surrogate(r, adv[b], cfg)
            loss += coef * w * pg
            grad[b, t] += coef * w * dpg * r
            if ref is not None and beta > 0:
                d = ref[b, t] - logp[b, t]
                loss += coef * beta * (np.exp(d) - d - 1)
                grad[b, t] += coef * beta * (1 - np.exp(d))
    return loss, grad


# ------------------------------------------------------------------------- inputs


def make_inputs(seed, spread=0.25, with_ref=True, seq_mask=None):
    rng = np.random.default_rng(seed)
    rewards = rng.integers(0, 2, size=(G, N)).astype(np.float64)
    rewards[0] = 1.0  # groups of equal rewards: all advantages 0
    rewards[1] = 0.0
    adv = np_grpo_adv(rewards)
    prox = -np.abs(rng.normal(size=(B, T))) * 2 - 0.05
    logp = prox + spread * rng.normal(size=(B, T))
    behav = prox + 0.6 * rng.normal(size=(B, T))
    ref = prox + 0.3 * rng.normal(size=(B, T))
    mask = np.zeros((B, T))
    for b in range(B):  # a prompt-like masked prefix, then a completion, then padding
        start = rng.integers(0, 3)
        mask[b, start : start + rng.integers(1, T - start + 1)] = 1.0
    mask[5] = 0.0  # a sequence without completion tokens
    pad = mask == 0
    # Padded positions hold garbage (fp32 exp overflows on it); the losses must ignore it.
    logp[pad] = 500.0
    prox[pad] = -500.0
    behav[pad] = -np.inf
    ref[pad] = 300.0
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    inp = losses.LossInputs(
        prox_logp=f32(prox),
        behavior_logp=f32(behav),
        advantages=f32(adv),
        loss_mask=f32(mask),
        ref_logp=f32(ref) if with_ref else None,
        seq_mask=None if seq_mask is None else f32(seq_mask),
    )
    return f32(logp), inp, rewards


def filter_mask(rewards):
    keep = rewards.max(1) > rewards.min(1)  # numpy twin of advantages.group_filter
    return np.repeat(keep, rewards.shape[1]).astype(np.float64)


def jax_value_and_grad(logp, inp, cfg):
    fn = jax.jit(jax.value_and_grad(lambda lp: losses.compute_loss(lp, inp, cfg), has_aux=True))
    (loss, metrics), grad = fn(logp)
    return float(loss), np.asarray(grad), {k: float(v) for k, v in metrics.items()}


# ------------------------------------------------------------------------------ tests


def test_registry():
    assert losses.available_losses() == ["dapo", "dr_grpo", "grpo", "gspo"]
    with pytest.raises(KeyError, match="unknown loss"):
        losses.get_loss("ppo2")
    with pytest.raises(ValueError, match="already registered"):
        losses.register_loss("grpo")(lambda *a: None)


@pytest.mark.parametrize("seed", [0, 1])
def test_numpy_reference_gradient_matches_finite_differences(seed):
    logp, inp, _ = make_inputs(seed)
    for name in losses.available_losses():
        cfg = losses.LossConfig(name=name, kl_coef=0.1, clip_eps=0.05 if name == "gspo" else 0.2)
        lp = np.asarray(logp, np.float64)
        _, grad = np_loss(lp, inp, cfg)
        h = 1e-6
        fd = np.zeros_like(lp)
        for b, t in zip(*np.nonzero(np.asarray(inp.loss_mask)), strict=True):
            up, dn = lp.copy(), lp.copy()
            up[b, t] += h
            dn[b, t] -= h
            fd[b, t] = (np_loss(up, inp, cfg)[0] - np_loss(dn, inp, cfg)[0]) / (2 * h)
        np.testing.assert_allclose(grad, fd, atol=1e-7, err_msg=name)


CASES = [
    (name, mode, kl, filt)
    for name in ("grpo", "dr_grpo", "dapo", "gspo")
    for mode in ("truncate", "mask", "none")
    for kl, filt in ((0.0, False), (0.05, True))
]


@pytest.mark.parametrize("name,mode,kl,filt", CASES)
def test_loss_matches_numpy(name, mode, kl, filt):
    seed = 3
    _, _, rewards = make_inputs(seed)
    seq_mask = filter_mask(rewards) if filt else None
    spread = 0.6 if name == "gspo" else 0.25  # so that sequence ratios also get clipped
    logp, inp, _ = make_inputs(seed, spread=spread, seq_mask=seq_mask)
    cfg = losses.LossConfig(
        name=name,
        clip_eps=0.2,
        clip_eps_high=0.28 if name == "dapo" else None,
        is_mode=mode,
        is_cap=1.25 if name == "gspo" else 2.0,
        kl_coef=kl,
        dr_grpo_constant=12.0 if filt else None,
    )
    loss, grad, metrics = jax_value_and_grad(logp, inp, cfg)
    ref_loss, ref_grad = np_loss(np.asarray(logp), inp, cfg)
    assert np.isfinite(loss) and np.all(np.isfinite(grad))
    np.testing.assert_allclose(loss, ref_loss, atol=1e-5, rtol=0)
    np.testing.assert_allclose(grad, ref_grad, atol=1e-5, rtol=0)
    assert np.abs(ref_grad).max() > 1e-3  # the comparison is not between zeros
    assert metrics["loss"] == pytest.approx(loss)
    # The random batch exercises both branches of the clip and of the IS cap.
    assert 0.0 < metrics["clip_frac"] < 1.0
    assert metrics["is_weight/max"] > cfg.is_cap > metrics["is_weight/min"]
    exceed = metrics["is_weight/clipped_frac"] + metrics["is_weight/masked_frac"]
    assert (exceed > 0) == (mode != "none")
    assert "kl" in metrics and metrics["kl"] > 0


OFF_POLICY_CASES = [
    (name, mode, filt)
    for name in ("grpo", "dr_grpo", "dapo", "gspo")
    for mode in ("tis", "token_mis", "seq_mis", "geo_seq")
    for filt in (False, True)
]


@pytest.mark.parametrize("name,mode,filt", OFF_POLICY_CASES)
def test_off_policy_corrections_match_numpy(name, mode, filt):
    """`off_policy`: two-sided masks (token, sequence) and the geometric-mean sequence
    weight, against the numpy loop; the batch has weights beyond both ends of [1/c, c]."""
    seed = 8
    _, _, rewards = make_inputs(seed)
    seq_mask = filter_mask(rewards) if filt else None
    logp, inp, _ = make_inputs(seed, spread=0.6 if name == "gspo" else 0.25, seq_mask=seq_mask)
    cfg = losses.LossConfig(
        name=name,
        clip_eps_high=0.28 if name == "dapo" else None,
        off_policy=mode,
        # geometric means spread less than token or full-sequence ratios
        is_cap=1.25 if mode == "geo_seq" or (name == "gspo" and mode != "seq_mis") else 2.0,
    )  # no KL term: it would put gradient on the masked tokens too
    loss, grad, metrics = jax_value_and_grad(logp, inp, cfg)
    ref_loss, ref_grad = np_loss(np.asarray(logp), inp, cfg)
    np.testing.assert_allclose(loss, ref_loss, atol=1e-5, rtol=0)
    np.testing.assert_allclose(grad, ref_grad, atol=1e-5, rtol=0)
    assert np.abs(ref_grad).max() > 1e-3
    # Raw weights on both sides of [1/c, c]; a fraction (not all, not none) dropped or cut.
    assert metrics["is_weight/max"] > cfg.is_cap and metrics["is_weight/min"] < 1 / cfg.is_cap
    cut = "is_weight/masked_frac" if mode in ("token_mis", "seq_mis") else "is_weight/clipped_frac"
    assert 0.0 < metrics[cut] < 1.0
    if name != "gspo":  # the token losses: which tokens carry gradient
        m = np.asarray(inp.loss_mask) * (1.0 if seq_mask is None else seq_mask[:, None])
        w = np_token_weights(
            np.asarray(inp.prox_logp, np.float64), np.asarray(inp.behavior_logp, np.float64), m, cfg
        )
        if mode in ("token_mis", "seq_mis"):  # masked tokens (sequences) get no gradient
            dropped = (m > 0) & (w == 0)
            assert dropped.any() and np.all(grad[dropped] == 0)
        if mode in ("seq_mis", "geo_seq"):  # one weight per sequence
            for b in np.nonzero(m.sum(1))[0]:
                assert np.ptp(w[b][m[b] > 0]) == 0


def test_off_policy_names_and_is_mode():
    """is_mode is the older spelling of three of the corrections; both at once is refused."""
    for is_mode, name in (("truncate", "tis"), ("mask", "mask"), ("none", "none")):
        assert losses.LossConfig(is_mode=is_mode).correction == name
        assert losses.LossConfig(off_policy=name).correction == name
    logp, inp, _ = make_inputs(9)
    for is_mode, name in (("truncate", "tis"), ("mask", "mask"), ("none", "none")):
        a = jax_value_and_grad(logp, inp, losses.LossConfig(is_mode=is_mode))
        b = jax_value_and_grad(logp, inp, losses.LossConfig(off_policy=name))
        assert a[0] == b[0] and np.array_equal(a[1], b[1])
    with pytest.raises(ValueError, match="off_policy must be one of"):
        losses.LossConfig(off_policy="icepop2")
    with pytest.raises(ValueError, match="not both"):
        losses.LossConfig(is_mode="mask", off_policy="token_mis")


def test_padding_values_do_not_matter():
    logp, inp, _ = make_inputs(4)
    cfg = losses.LossConfig(name="grpo", kl_coef=0.1)
    pad = np.asarray(inp.loss_mask) == 0
    loss, grad, _ = jax_value_and_grad(logp, inp, cfg)
    clean = lambda x: jnp.where(pad, 0.0, x)
    inp2 = dataclasses.replace(
        inp,
        prox_logp=clean(inp.prox_logp),
        behavior_logp=clean(inp.behavior_logp),
        ref_logp=clean(inp.ref_logp),
    )
    loss2, grad2, _ = jax_value_and_grad(clean(logp), inp2, cfg)
    assert loss == pytest.approx(loss2, abs=1e-7)
    np.testing.assert_array_equal(grad[pad], 0.0)
    np.testing.assert_allclose(grad, grad2, atol=1e-8)


def test_on_policy_first_step_is_reinforce():
    """prox == behavior == logp, is_mode 'none': value 0 at A-mean 0, gradient -A/(n K)."""
    logp, inp, _ = make_inputs(5)
    inp = dataclasses.replace(inp, prox_logp=logp, behavior_logp=logp, ref_logp=None)
    _, grad, metrics = jax_value_and_grad(logp, inp, losses.LossConfig(is_mode="none"))
    m = np.asarray(inp.loss_mask)
    n = m.sum(1)
    keep = n > 0
    expect = -np.asarray(inp.advantages)[:, None] * m / np.maximum(n, 1)[:, None] / keep.sum()
    np.testing.assert_allclose(grad, expect, atol=1e-7)
    assert metrics["clip_frac"] == 0.0 and metrics["is_weight/mean"] == pytest.approx(1.0)


def test_equal_reward_groups_filter_only_changes_normalizer():
    """dapo with the group filter equals dapo on the batch with those sequences removed."""
    logp, inp, rewards = make_inputs(6, seq_mask=None)
    keep = filter_mask(rewards)
    cfg = losses.LossConfig(name="dapo", clip_eps_high=0.28)
    loss_f, grad_f, _ = jax_value_and_grad(logp, dataclasses.replace(inp, seq_mask=keep), cfg)
    idx = np.nonzero(keep)[0]
    sub = jax.tree.map(lambda x: x[idx], inp)
    loss_s, grad_s, _ = jax_value_and_grad(logp[idx], sub, cfg)
    # Sums over other shapes (other order): rounding of the terms' size, |A| * ratio.
    scale = 2 * np.abs(np.asarray(inp.advantages)).max()
    assert_close_at_scale(loss_f, loss_s, scale=scale, err_msg="loss")
    np.testing.assert_allclose(grad_f[idx], grad_s, atol=1e-7)
    assert np.all(grad_f[keep == 0] == 0)


def test_bad_inputs_raise():
    logp, inp, _ = make_inputs(7)
    with pytest.raises(ValueError, match="is_mode"):
        losses.LossConfig(is_mode="clip")
    with pytest.raises(ValueError, match="unknown loss"):
        losses.LossConfig(name="ppo2")
    with pytest.raises(ValueError, match="clip_eps"):
        losses.LossConfig(clip_eps=0.0)
    with pytest.raises(ValueError, match="ref_logp"):
        losses.compute_loss(
            logp, dataclasses.replace(inp, ref_logp=None), losses.LossConfig(kl_coef=0.1)
        )
    with pytest.raises(ValueError, match="prox_logp"):
        losses.compute_loss(logp[:, :-1], inp, losses.LossConfig())
    with pytest.raises(ValueError, match="advantages"):
        bad = dataclasses.replace(inp, advantages=inp.advantages[:-1])
        losses.compute_loss(logp, bad, losses.LossConfig())


# ------------------------------------------------------------ stale-rollout bandit

ARM_VALUE = jnp.array([1.0, 0.6, 0.4, 0.3, 0.2, 0.0])  # arm 0 is best, and unlikely at init
INIT_LOGITS = jnp.array([-3.0, 0.0, 0.0, 0.0, 0.0, 1.0])


@functools.cache
def stale_bandit_runner(is_mode, corrected, steps=100, staleness=16, epochs=4, lr=0.1):
    """Softmax policy over 6 arms; a 'completion' is 8 i.i.d. arms, its reward their mean
    value. Step k trains (4 Adam epochs, GRPO advantages over 8 groups of 8) on samples
    drawn from the parameters of step k - 16. Corrected: prox = the learner's parameters
    at the start of the update, plus the IS weight. Uncorrected: prox = behavior (plain
    PPO against the stale sampler). Returns a jitted key -> (E[reward] per step, metrics)."""
    groups, n, t_len = 8, 8, 8
    cfg = losses.LossConfig(name="grpo", is_mode=is_mode, is_cap=2.0)
    adv_cfg = advantages.AdvantageConfig("grpo")
    tx = optax.adam(lr)
    mask = jnp.ones((groups * n, t_len))

    def step(carry, k):
        theta, opt_state, history, key = carry
        behav_theta = history[jnp.maximum(0, k - staleness)]
        key, sub = jax.random.split(key)
        arms = jax.random.categorical(sub, behav_theta, shape=(groups * n, t_len))  # [B, T]
        rewards = ARM_VALUE[arms].mean(axis=1).reshape(groups, n)
        adv, _ = advantages.compute_advantages(rewards, adv_cfg)
        behav_lp = jax.nn.log_softmax(behav_theta)[arms]
        prox_lp = jax.nn.log_softmax(theta)[arms] if corrected else behav_lp
        inp = losses.LossInputs(
            prox_logp=prox_lp, behavior_logp=behav_lp, advantages=adv, loss_mask=mask
        )
        loss_fn = lambda th: losses.compute_loss(jax.nn.log_softmax(th)[arms], inp, cfg)
        first = None
        for _ in range(epochs):
            (_, metrics), g = jax.value_and_grad(loss_fn, has_aux=True)(theta)
            first = metrics if first is None else first  # IS stats are fixed per batch
            upd, opt_state = tx.update(g, opt_state, theta)
            theta = optax.apply_updates(theta, upd)
        history = history.at[k + 1].set(theta)
        expected = jax.nn.softmax(theta) @ ARM_VALUE
        return (theta, opt_state, history, key), (expected, first)

    def run(key):
        history = jnp.tile(INIT_LOGITS, (steps + 1, 1))  # [steps + 1, arms]
        carry = (INIT_LOGITS, tx.init(INIT_LOGITS), history, key)
        return jax.lax.scan(step, carry, jnp.arange(steps))[1]

    return jax.jit(run)


def run_stale_bandit(is_mode, corrected, seed):
    expected, metrics = stale_bandit_runner(is_mode, corrected)(jax.random.PRNGKey(seed))
    return np.asarray(expected), {k: np.asarray(v) for k, v in metrics.items()}


def test_stale_rollouts_corrected_loss_is_stable():
    """Over 8 seeds: the decoupled-PPO loss (truncated or masked IS) climbs to the best arm
    without setbacks; plain PPO against the 16-versions-old sampler keeps falling back."""
    seeds = range(8)
    drop = lambda er: float(np.max(er[:-1] - er[1:]))  # largest one-step fall of E[reward]
    runs = {
        mode: [run_stale_bandit(mode, mode != "none", s) for s in seeds]
        for mode in ("truncate", "mask", "none")
    }
    for mode, rs in runs.items():
        print(mode, [(round(float(er[-1]), 3), round(drop(er), 3)) for er, _ in rs])
    worst_good_drop = 0.0
    for mode in ("truncate", "mask"):
        for er, _ in runs[mode]:
            assert er[-1] > 0.98  # learns the best arm ...
            assert drop(er) < 0.025  # ... and (almost) never loses ground on the way
            worst_good_drop = max(worst_good_drop, drop(er))
    bad = [er for er, _ in runs["none"]]
    good = [er for er, _ in runs["truncate"]]
    # Uncorrected: the trust region is centred on a policy 16 versions old, which pulls the
    # learner back towards it: every seed falls by far more than any corrected run, most
    # end well below their own peak, and on average far below the corrected runs.
    assert all(drop(er) > max(0.04, 2 * worst_good_drop) for er in bad)
    assert sum(er.max() - er[-1] > 0.05 for er in bad) >= len(bad) // 2
    assert np.mean([g[-1] - b[-1] for g, b in zip(good, bad, strict=True)]) > 0.1
    # The IS metrics are reported and sensible: weights far above the cap occur (the data
    # is stale); they are truncated (or masked) on a fraction of the tokens only.
    for mode, key in (("truncate", "is_weight/clipped_frac"), ("mask", "is_weight/masked_frac")):
        for _, m in runs[mode]:
            assert m["is_weight/max"].max() > 5.0
            assert 0.05 < m[key].max() < 1.0
            assert np.all(m["is_weight/applied_mean"] <= 2.0 + 1e-6)
            other = "is_weight/masked_frac" if mode == "truncate" else "is_weight/clipped_frac"
            assert np.all(m[other] == 0.0)
    # Without correction the weight is 1 by construction (prox == behavior).
    for _, m in runs["none"]:
        np.testing.assert_allclose(m["is_weight/mean"], 1.0, atol=1e-6)


def test_is_weight_makes_the_gradient_that_of_the_learner_policy():
    """Samples from a far-off behavior policy mu, evaluated at the start of an update (theta
    = prox): with the IS weight the loss gradient is the exact policy gradient -dJ/dtheta,
    J = E_pi[A]; without it, it is the gradient under mu, a different direction."""
    theta = jnp.array([1.5, 0.5, 0.0, -0.5, -1.0, -1.5])  # the learner (prox)
    mu = jnp.array([-1.5, -1.0, 0.0, 0.5, 1.0, 1.5])  # the stale sampler, far away
    value = jnp.array([1.0, 0.8, 0.5, 0.3, 0.1, 0.0])
    adv_of = value - jax.nn.softmax(theta) @ value  # any fixed baseline works
    exact = -jax.grad(lambda th: jax.nn.softmax(th) @ adv_of)(theta)
    arms = jax.random.categorical(jax.random.PRNGKey(0), mu, shape=(200_000, 1))  # [B, 1]
    inp = losses.LossInputs(
        prox_logp=jax.nn.log_softmax(theta)[arms],
        behavior_logp=jax.nn.log_softmax(mu)[arms],
        advantages=adv_of[arms[:, 0]],
        loss_mask=jnp.ones(arms.shape),
    )

    def grad(mode, cap):
        cfg = losses.LossConfig(name="grpo", is_mode=mode, is_cap=cap)
        loss_fn = lambda th: losses.compute_loss(jax.nn.log_softmax(th)[arms], inp, cfg)[0]
        return jax.jit(jax.grad(loss_fn))(theta)

    rel = lambda g: float(jnp.linalg.norm(g - exact) / jnp.linalg.norm(exact))
    cos = lambda g: float(g @ exact / (jnp.linalg.norm(g) * jnp.linalg.norm(exact)))
    unbiased, truncated, uncorrected = grad("truncate", 1e6), grad("truncate", 2.0), grad("none", 1)
    print(
        f"relative error: full IS {rel(unbiased):.3f}, truncated at 2 {rel(truncated):.3f}, "
        f"no IS {rel(uncorrected):.3f}; cosine {cos(unbiased):.3f} {cos(truncated):.3f} "
        f"{cos(uncorrected):.3f}"
    )
    assert rel(unbiased) < 0.05  # Monte-Carlo error only
    assert rel(uncorrected) > 0.5
    assert rel(truncated) < rel(uncorrected)  # truncation trades some bias for bounded variance
    assert cos(unbiased) > 0.99 and cos(truncated) > cos(uncorrected)


def trl_loss(logp, old, ref, adv, mask, name, beta, bias_correction, eps=0.2, eps_high=0.28):
    """TRL's GRPOTrainer._compute_loss in float64 numpy, for beta > 0, no vLLM IS correction
    and no delta / entropy mask: loss_type grpo, dr_grpo or dapo at importance_sampling_level
    'token', or grpo at 'sequence' (GSPO). `bias_correction` is GRPOConfig's
    use_bias_correction_kl: k3 times coef_1, the (differentiated) policy ratio."""
    log_ratio = logp - old
    if name == "gspo":  # sequence level: one length-normalized ratio per row, [B, 1]
        log_ratio = (log_ratio * mask).sum(-1, keepdims=True) / np.maximum(mask.sum(-1), 1)[:, None]
    coef_1 = np.exp(log_ratio)
    kl = np.exp(ref - logp) - (ref - logp) - 1
    if bias_correction:
        kl = kl * coef_1
    coef_2 = np.clip(coef_1, 1 - eps, 1 + eps_high)
    a = adv[:, None]
    per_token = -np.minimum(coef_1 * a, coef_2 * a) + beta * kl
    if name in ("grpo", "gspo"):
        return ((per_token * mask).sum(-1) / np.maximum(mask.sum(-1), 1)).mean()
    if name == "dr_grpo":
        return (per_token * mask).sum() / (per_token.shape[0] * per_token.shape[1])
    return (per_token * mask).sum() / mask.sum()  # dapo


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "dapo", "gspo"])
@pytest.mark.parametrize("bias_correction", [False, True])
def test_kl_bias_correction_matches_trl_formula(name, bias_correction):
    """`kl_bias_correction` against TRL's formula in numpy: value, and gradient by central
    differences of the float64 reference (independent of any hand derivation)."""
    rng = np.random.default_rng(11)
    b, t, beta = 6, 7, 0.3
    old = -np.abs(rng.normal(size=(b, t))) * 2 - 0.05
    logp = old + 0.3 * rng.normal(size=(b, t))  # prox != logp: the ratio is not 1
    ref = old + 0.5 * rng.normal(size=(b, t))
    adv = rng.normal(size=b)
    mask = np.zeros((b, t))
    for i in range(b):  # every row has tokens (TRL's mean counts empty rows, ours drops them)
        start = rng.integers(0, 3)
        mask[i, start : start + rng.integers(1, t - start + 1)] = 1.0
    cfg = losses.LossConfig(
        name=name,
        clip_eps=0.2,
        clip_eps_high=0.28,
        off_policy="none",
        kl_coef=beta,
        kl_bias_correction=bias_correction,
    )
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    inp = losses.LossInputs(
        prox_logp=f32(old),
        behavior_logp=f32(old),
        advantages=f32(adv),
        loss_mask=f32(mask),
        ref_logp=f32(ref),
    )
    # The reference sees the same float32 inputs, in float64.
    lp, old, ref, adv = (np.asarray(f32(x), np.float64) for x in (logp, old, ref, adv))

    def reference(x):
        return trl_loss(x, old, ref, adv, mask, name, beta, bias_correction)

    want = reference(lp)
    h, want_grad = 1e-6, np.zeros_like(lp)
    for i, j in zip(*np.nonzero(mask), strict=True):
        step = np.zeros_like(lp)
        step[i, j] = h
        want_grad[i, j] = (reference(lp + step) - reference(lp - step)) / (2 * h)
    loss, grad, _ = jax_value_and_grad(f32(logp), inp, cfg)
    # float32 sums of terms of magnitude |A| r + beta k3 r (a few units)
    scale = (np.abs(adv).max() + beta * np.exp(np.abs(ref - lp).max())) * np.exp(
        np.abs(lp - old).max()
    )
    assert_close_at_scale(loss, want, scale=scale)
    assert_close_at_scale(grad, want_grad, scale=np.abs(want_grad).max())
