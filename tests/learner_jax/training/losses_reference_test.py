"""Every loss of learner_jax/training/losses.py, at random settings of every knob (loss, off-policy
correction, clip range and clip-higher, IS cap, KL weight and its schedule factor, the KL
bias correction, Dr. GRPO's constant, the entropy bonus, sequence masks), against a
vectorized float64 numpy reference of the module docstring's formulas: the loss, its
gradient (derived by hand below) and every metric.

losses_test.py checks the same losses against a token-by-token reference on a fixed grid
of settings (and slower properties: finite differences, a stale-rollout bandit); this file
is the fast one, shaped for mutation testing (bench/mutants_targets.toml).

Tolerance: each value is a float32 computation of at most B*T = 24 terms, each an exp of an
O(1) log-ratio times an O(1) weight; it is compared within `ULPS` float32 ulps of the sum of
the terms' magnitudes (tests/float_tolerance.py). Inputs whose ratio lies within 1e-4 of a
branch's edge (a clip edge, the IS cap) are skipped: float32 rounding may take either
branch there.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float_tolerance import EPS32
from hypothesis import Phase, assume, given, settings
from hypothesis import strategies as st

from learner_jax.training import losses

B, T = 6, 4
ULPS = 256
EDGE = 1e-4
LOSSES = ("grpo", "dr_grpo", "dapo", "gspo")


def _inputs(seed, seq_mask, with_ref, with_entropy, kl_scale):
    rng = np.random.default_rng(seed)
    prox = -np.abs(rng.normal(size=(B, T))) - 0.05
    logp = prox + 0.3 * rng.normal(size=(B, T))
    behav = prox + 0.5 * rng.normal(size=(B, T))
    ref = prox + 0.3 * rng.normal(size=(B, T))
    mask = (rng.random((B, T)) < 0.7).astype(np.float64)
    mask[0] = 0.0  # a sequence without completion tokens
    mask[1] = 1.0  # and one that is all completion
    mask[3] = (0.0, 0.0, 1.0, 0.0)  # and one of a single token
    pad = mask == 0
    # Padded positions hold garbage (exp of it overflows float32): it must not count.
    logp[pad], prox[pad], behav[pad], ref[pad] = 200.0, -200.0, -np.inf, 150.0
    f32 = lambda x: np.asarray(x, np.float32).astype(np.float64)  # what the loss sees
    data = dict(
        logp=f32(logp), prox=f32(prox), behav=f32(behav), ref=f32(ref), mask=mask,
        adv=f32(rng.normal(size=B)), seq=None if seq_mask is None else np.asarray(seq_mask, float),
        ent=f32(rng.random((B, T)) * 3) if with_entropy else None,
        kl_scale=kl_scale, with_ref=with_ref,
    )  # fmt: skip
    j = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
    inp = losses.LossInputs(
        prox_logp=j(data["prox"]),
        behavior_logp=j(data["behav"]),
        advantages=j(data["adv"]),
        loss_mask=j(mask),
        ref_logp=j(data["ref"]) if with_ref else None,
        seq_mask=j(data["seq"]),
        entropy=j(data["ent"]),
        kl_scale=None if kl_scale is None else jnp.float32(kl_scale),
    )
    return data, inp


def _weight(raw, mode, cap):
    """W of one raw ratio array under `mode`, and which entries exceed (clipped/masked)."""
    over = raw > cap
    if mode in ("token_mis", "seq_mis"):
        over = over | (raw < 1.0 / cap)
    if mode in ("tis", "geo_seq"):
        return np.minimum(raw, cap), over
    if mode in ("mask", "token_mis", "seq_mis"):
        return np.where(over, 0.0, raw), over
    return np.ones_like(raw), over


def _mmean(x, m):
    return (x * m).sum() / max(m.sum(), 1.0)


def _weight_metrics(raw, w, over, valid, mode):
    frac = _mmean(over.astype(float), valid)
    on = valid > 0
    return {
        "is_weight/mean": _mmean(raw, valid),
        "is_weight/max": np.max(np.where(on, raw, 0.0)),
        "is_weight/min": np.min(np.where(on, raw, np.inf)) if on.any() else 0.0,
        "is_weight/applied_mean": _mmean(w, valid),
        "is_weight/clipped_frac": frac if mode in ("tis", "geo_seq") else 0.0,
        "is_weight/masked_frac": frac if mode in ("mask", "token_mis", "seq_mis") else 0.0,
    }


def _edges(x, *edges):
    """Whether any entry of x lies within EDGE (relative) of an edge."""
    return any(np.any(np.abs(x - e) <= EDGE * max(abs(e), 1.0)) for e in edges)


def reference(d, cfg):
    """(loss, dloss/dlogp [B, T], metrics, scale, near_edge) in float64."""
    m = d["mask"] * (1.0 if d["seq"] is None else d["seq"][:, None])
    n = m.sum(1)
    n1, keep = np.maximum(n, 1.0), (n > 0).astype(float)
    k = max(keep.sum(), 1.0)
    on = m > 0
    dl = np.where(on, d["logp"] - d["prox"], 0.0)
    log_w = np.where(on, d["prox"] - d["behav"], 0.0)
    lo, hi = 1.0 - cfg.clip_eps, 1.0 + cfg.eps_high
    mode, cap = cfg.correction, cfg.is_cap
    beta = cfg.kl_coef * (1.0 if d["kl_scale"] is None else d["kl_scale"])
    use_kl = d["with_ref"] and cfg.kl_coef > 0
    dref = np.where(on, d["ref"] - d["logp"], 0.0)
    k3 = np.maximum(np.expm1(dref) - dref, 0.0)
    dk3 = 1.0 - np.exp(dref)  # d k3 / d logp
    if cfg.name == "gspo":
        s = np.exp(dl.sum(1) / n1)  # [B]
        lw = log_w.sum(1) if mode == "seq_mis" else log_w.sum(1) / n1
        raw = np.exp(np.minimum(lw, 60.0))
        wmode = "tis" if mode == "geo_seq" else mode
        w, over = _weight(raw, wmode, cap)
        metrics = _weight_metrics(raw, w, over, keep, wmode)
        c = np.clip(s, lo, hi)
        a = d["adv"]
        clipped = c * a < s * a
        pg = -np.minimum(s * a, c * a)
        pg_loss = (pg * w * keep).sum() / k
        dpg_ds = np.where(clipped, 0.0, -a)
        grad = (keep * w * dpg_ds * s / n1 / k)[:, None] * m
        loss, scale = pg_loss, np.abs(pg * w * keep).sum() / k
        edge = _edges(s, lo, hi) or _edges(raw, cap, 1.0 / cap)
        if use_kl:
            kl = k3 * s[:, None] if cfg.kl_bias_correction else k3
            loss = loss + beta * (keep * (kl * m).sum(1) / n1).sum() / k
            scale += abs(beta) * (keep * np.abs(kl * m).sum(1) / n1).sum() / k
            gk = dk3 * s[:, None] if cfg.kl_bias_correction else dk3
            grad = grad + beta * (keep / n1 / k)[:, None] * m * gk
            if cfg.kl_bias_correction:  # d s_b / d logp_bt = s_b m_bt / n_b
                grad = grad + beta * ((keep / n1 / k) * (k3 * m).sum(1) * s / n1)[:, None] * m
        metrics.update(clip_frac=_mmean(clipped.astype(float), keep), ratio_mean=_mmean(s, keep))
    else:
        r = np.exp(dl)
        if mode in ("seq_mis", "geo_seq"):
            ls = (log_w * m).sum(1)
            ls = ls / n1 if mode == "geo_seq" else ls
            raw = np.exp(np.minimum(ls, 60.0))
            wseq, over = _weight(raw, mode, cap)
            metrics = _weight_metrics(raw, wseq, over, keep, mode)
            w = np.broadcast_to(wseq[:, None], (B, T))
        else:
            raw = np.exp(np.minimum(log_w, 60.0))
            w, over = _weight(raw, mode, cap)
            metrics = _weight_metrics(raw, w, over, m, mode)
        if cfg.name == "grpo":
            coef = (keep / n1 / k)[:, None] * m
        elif cfg.name == "dr_grpo":
            const = T if cfg.dr_grpo_constant is None else cfg.dr_grpo_constant
            coef = (keep / const / k)[:, None] * m
        else:
            coef = m / max(m.sum(), 1.0)
        a = d["adv"][:, None]
        c = np.clip(r, lo, hi)
        clipped = c * a < r * a
        pg = -np.minimum(r * a, c * a) * w
        pg_loss = (coef * pg).sum()
        grad = coef * w * np.where(clipped, 0.0, -a) * r
        loss, scale = pg_loss, np.abs(coef * pg).sum()
        edge = _edges(r[on], lo, hi) or _edges(raw, cap, 1.0 / cap)
        if use_kl:
            kl = k3 * r if cfg.kl_bias_correction else k3
            loss = loss + beta * (coef * kl).sum()
            scale += abs(beta) * np.abs(coef * kl).sum()
            gk = dk3 * r + k3 * r if cfg.kl_bias_correction else dk3
            grad = grad + beta * coef * gk
        metrics.update(clip_frac=_mmean(clipped.astype(float), m), ratio_mean=_mmean(r, m))
    if d["with_ref"]:
        metrics["kl"] = _mmean(k3, m)
        if cfg.kl_coef > 0:
            metrics["kl_coef"] = beta
    metrics.update(pg_loss=pg_loss, tokens=m.sum())
    if cfg.entropy_coef > 0:
        bonus = _mmean(d["ent"], m)
        loss = loss - cfg.entropy_coef * bonus
        scale += cfg.entropy_coef * bonus
    metrics["loss"] = loss
    return loss, grad, metrics, scale + 1e-3, edge


def _close(got, want, scale, what):
    tol = ULPS * EPS32 * scale
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=tol, rtol=0, err_msg=what)


def _run(d, inp, cfg):
    fn = jax.value_and_grad(lambda lp: losses.compute_loss(lp, inp, cfg), has_aux=True)
    (loss, metrics), grad = fn(jnp.asarray(d["logp"], jnp.float32))
    return float(loss), np.asarray(grad, np.float64), {k: float(v) for k, v in metrics.items()}


def _check_against_reference(d, inp, cfg, drawn=False, exact_edges=False):
    """`drawn`: inputs drawn by hypothesis, which skips those at an edge; a fixed input
    must not be at one, unless it sits there exactly (`exact_edges`: float32 computes
    the same value as float64 there)."""
    want_loss, want_grad, want_m, scale, edge = reference(d, cfg)
    if drawn:
        assume(not edge)
    assert exact_edges or not edge, "a ratio at a branch's edge: pick another seed"
    loss, grad, metrics = _run(d, inp, cfg)
    _close(loss, want_loss, scale, "loss")
    # each gradient entry is one token's terms: at the scale of the largest of them
    _close(grad, want_grad, scale + np.abs(want_grad).max(), "grad")
    assert set(metrics) == set(want_m)
    for key, want in want_m.items():
        mag = max(abs(want), 1.0) if key.startswith(("is_weight", "tokens", "ratio")) else scale
        _close(metrics[key], want, mag, key)


# No shrinking: the drawn values are a seed and a handful of settings, readable as they
# are; a failing example is reported at once (mutation runs fail hundreds of times).
settings_ = settings(
    max_examples=20, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate]
)
_cfgs = st.fixed_dictionaries(
    dict(
        name=st.sampled_from(LOSSES),
        off_policy=st.sampled_from(losses.OFF_POLICY),
        clip_eps=st.sampled_from([0.05, 0.2, 0.35]),
        clip_eps_high=st.sampled_from([None, 0.28, 0.5]),
        is_cap=st.sampled_from([1.3, 2.0, 4.0]),
        kl_coef=st.sampled_from([0.0, 0.05, 0.7]),
        kl_bias_correction=st.booleans(),
        dr_grpo_constant=st.sampled_from([None, 3.0, 11.0]),
        entropy_coef=st.sampled_from([0.0, 0.01, 0.3]),
    )
)


@settings_
@given(
    cfg=_cfgs,
    seed=st.integers(0, 2**31),
    seq=st.sampled_from(
        [None, (1, 1, 1, 1, 1, 1), (1, 1, 0, 1, 0, 1), (0,) * B, (0, 0, 0, 1, 0, 0)]
    ),
    kl_scale=st.sampled_from([None, 0.5]),
)
def test_every_loss_and_knob_matches_the_float64_reference(cfg, seed, seq, kl_scale):
    cfg = losses.LossConfig(**cfg)
    d, inp = _inputs(seed, seq, True, cfg.entropy_coef > 0, kl_scale)
    _check_against_reference(d, inp, cfg, drawn=True)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("off_policy", losses.OFF_POLICY)
@pytest.mark.parametrize("bias", [False, True])
def test_each_loss_with_each_correction(name, off_policy, bias):
    # Every (loss, correction) pair, which random draws may miss; a cap of 1.5 puts some
    # weights (token and sequence) past it on both sides, a sequence is dropped by its mask.
    cfg = losses.LossConfig(name=name, off_policy=off_policy, clip_eps=0.2, clip_eps_high=0.28,
                            is_cap=1.5, kl_coef=0.05, kl_bias_correction=bias,
                            entropy_coef=0.01)  # fmt: skip
    d, inp = _inputs(0, (1, 1, 0, 1, 1, 1), True, True, 0.5)
    _check_against_reference(d, inp, cfg)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("off_policy", ["tis", "geo_seq"])
def test_one_kept_sequence_of_one_token(name, off_policy):
    # The batch mean over one sequence, a length normalization by one token.
    cfg = losses.LossConfig(name=name, off_policy=off_policy, kl_coef=0.05)
    d, inp = _inputs(0, (0, 0, 0, 1, 0, 0), True, False, None)
    _check_against_reference(d, inp, cfg)


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("off_policy", ["tis", "mask", "token_mis", "seq_mis"])
def test_a_weight_exactly_at_the_cap_is_kept(name, off_policy):
    # behavior == prox: every weight is exp(0) = 1 exactly, at the cap 1.0 and at 1 / cap,
    # inside [1/c, c]: nothing is clipped or masked. The ratios r are seed 0's, which the
    # test above checks are off the clip edges.
    d, inp = _inputs(0, (1, 1, 0, 1, 1, 1), True, False, None)
    d["behav"] = np.where(d["mask"] > 0, d["prox"], d["behav"])
    inp = losses.LossInputs(**{**vars(inp), "behavior_logp": jnp.asarray(d["behav"], jnp.float32)})
    cfg = losses.LossConfig(name=name, off_policy=off_policy, clip_eps=0.2, clip_eps_high=0.28,
                            is_cap=1.0)  # fmt: skip
    _check_against_reference(d, inp, cfg, exact_edges=True)
    _, _, metrics = _run(d, inp, cfg)
    assert metrics["is_weight/masked_frac"] == 0.0 and metrics["is_weight/clipped_frac"] == 0.0


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("mode", ["truncate", "mask", "none"])
def test_is_mode_names_the_older_corrections(name, mode):
    cfg = losses.LossConfig(name=name, is_mode=mode, clip_eps=0.2)
    d, inp = _inputs(7, None, False, False, None)
    _check_against_reference(d, inp, cfg)


def test_without_a_reference_there_is_no_kl_term():
    cfg = losses.LossConfig(name="grpo", off_policy="tis", kl_coef=0.0)
    d, inp = _inputs(3, None, False, False, None)
    _check_against_reference(d, inp, cfg)
    _, _, metrics = _run(d, inp, cfg)
    assert "kl" not in metrics and "kl_coef" not in metrics


@pytest.mark.parametrize("name", LOSSES)
def test_a_huge_log_weight_is_clamped_in_the_metrics(name):
    # log w = 60.5 on one token: the weight metrics see exp(60) (finite in float32), the
    # loss the capped weight; gspo (mean log w over its tokens) and the others alike.
    d, inp = _inputs(12, None, False, False, None)
    on = np.argwhere(d["mask"][1] > 0)[:, 0]
    behav = d["behav"].copy()
    behav[1, on] = d["prox"][1, on] - 60.5
    d["behav"] = np.asarray(behav, np.float32).astype(np.float64)
    inp = losses.LossInputs(**{**vars(inp), "behavior_logp": jnp.asarray(behav, jnp.float32)})
    cfg = losses.LossConfig(name=name, off_policy="tis", is_cap=2.0)
    _, _, metrics = _run(d, inp, cfg)
    assert np.isfinite(metrics["is_weight/max"])
    np.testing.assert_allclose(metrics["is_weight/max"], np.exp(60.0), rtol=1e-5)
    _check_against_reference(d, inp, cfg)


def test_the_entropy_bonus_needs_the_entropy():
    cfg = losses.LossConfig(entropy_coef=0.1)
    d, inp = _inputs(0, None, False, False, None)
    with pytest.raises(ValueError):
        losses.compute_loss(jnp.asarray(d["logp"], jnp.float32), inp, cfg)
    wrong = losses.LossInputs(**{**vars(inp), "entropy": jnp.zeros((B, T + 1))})
    with pytest.raises(ValueError):
        losses.compute_loss(jnp.asarray(d["logp"], jnp.float32), wrong, cfg)
