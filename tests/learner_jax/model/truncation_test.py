"""The learner's min-p / top-k / top-p (learner_jax/model/truncation.py) against vLLM's own code.

vLLM 0.32's sampler functions run here on the same float64 logits: `MinPLogitsProcessor.apply`,
then `apply_top_k_only` (top-k alone, the CPU path) or `apply_top_k_top_p_pytorch`, then
log-softmax, exactly as `Sampler.sample` -> `TopKTopPSampler.forward_cpu` orders them. The
kept sets must be identical and the log-probs equal to float64 rounding; the chunked path
(`chunked_token_stats`) must give the full path's numbers and finite gradients.
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import enable_x64

from learner_jax.model import logprobs
from learner_jax.model.truncation import Truncation, kept

torch = pytest.importorskip("torch")
topk_topp = pytest.importorskip("vllm.v1.sample.ops.topk_topp_sampler")
builtin = pytest.importorskip("vllm.v1.sample.logits_processor.builtin")

B, V, T_SAMPLE = 48, 257, 0.7
SETTINGS = [
    Truncation(top_p=0.9),
    Truncation(top_k=8),
    Truncation(min_p=0.1),
    Truncation(top_p=0.8, top_k=20),
    Truncation(top_p=0.95, top_k=40, min_p=0.05),
    Truncation(top_p=0.3),  # often only the most likely token survives
]


def vllm_processed(logits: np.ndarray, t: Truncation) -> np.ndarray:
    """vLLM's processed log-probs [B, V] of float64 tempered logits [B, V]."""
    x = torch.from_numpy(logits.copy())
    if t.min_p > 0:
        cfg = types.SimpleNamespace(scheduler_config=types.SimpleNamespace(max_num_seqs=len(x)))
        proc = builtin.MinPLogitsProcessor(cfg, torch.device("cpu"), False)
        proc.min_p, proc.min_p_count = torch.full((len(x), 1), t.min_p, dtype=x.dtype), len(x)
        x = proc.apply(x)
    k = torch.full((len(x),), t.top_k, dtype=torch.long) if t.top_k > 0 else None
    p = torch.full((len(x),), t.top_p, dtype=x.dtype) if t.top_p < 1 else None
    if p is None and k is not None:
        x = topk_topp.apply_top_k_only(x, k)
    else:
        x = topk_topp.apply_top_k_top_p_pytorch(x, k, p)
    return x.log_softmax(dim=-1).numpy()


@pytest.fixture(scope="module")
def tempered():
    rng = np.random.default_rng(0)
    return rng.normal(0.0, 3.0, (B, V)) / T_SAMPLE  # float64


@pytest.mark.parametrize("t", SETTINGS, ids=str)
def test_kept_set_and_logprobs_match_vllm(tempered, t):
    ref = vllm_processed(tempered, t)
    with enable_x64():
        mine = np.asarray(kept(jnp.asarray(tempered), t))
        assert mine.dtype == bool
        np.testing.assert_array_equal(mine, np.isfinite(ref))
        # targets drawn from vLLM's processed distribution, scored by the learner
        rng = np.random.default_rng(1)
        probs = np.exp(ref)
        targets = np.array([rng.choice(V, p=row / row.sum()) for row in probs])
        logp, entropy, _ = logprobs.token_stats(
            jnp.asarray(tempered[:, None]), jnp.asarray(targets[:, None]), 1.0, t
        )
    want = ref[np.arange(B), targets]
    np.testing.assert_allclose(np.asarray(logp)[:, 0], want, rtol=0, atol=1e-12)
    safe = np.where(np.isfinite(ref), ref, 0.0)
    np.testing.assert_allclose(
        np.asarray(entropy)[:, 0], -(probs * safe).sum(-1), rtol=0, atol=1e-12
    )
    # the full softmax would be a different distribution (the check can fail)
    full = tempered - np.log(np.exp(tempered).sum(-1, keepdims=True))
    assert np.abs(full[np.arange(B), targets] - want).max() > 1e-3


def test_a_target_outside_the_kept_set_stays_finite(tempered):
    """At a later version the sampled token may no longer be kept: finite, not NaN/-inf."""
    t = Truncation(top_k=4)
    worst = np.argmin(tempered, axis=-1)  # never in the top 4
    with enable_x64():
        logp, entropy, _ = logprobs.token_stats(
            jnp.asarray(tempered[:, None]), jnp.asarray(worst[:, None]), 1.0, t
        )
    assert np.all(np.isfinite(np.asarray(logp))) and np.all(np.isfinite(np.asarray(entropy)))
    assert np.all(np.asarray(logp) < -5.0)


def test_chunked_path_matches_full_path_with_finite_gradients():
    rng = np.random.default_rng(2)
    b, t_len, d, v = 2, 7, 16, 97
    trunc = Truncation(top_p=0.9, top_k=30, min_p=0.02)
    with enable_x64():
        hidden = jnp.asarray(rng.normal(size=(b, t_len, d)))
        weight = jnp.asarray(rng.normal(size=(d, v)) / 4)
        targets = jnp.asarray(rng.integers(0, v, (b, t_len)))

        def full(w):
            logits = jnp.einsum("btd,dv->btv", hidden, w)
            lp, ent, _ = logprobs.token_stats(logits, targets, T_SAMPLE, trunc)
            return lp.sum() + ent.sum(), (lp, ent)

        def chunked(w):
            lp, ent, _ = logprobs.chunked_token_stats(
                hidden, w, "bcd,dv->bcv", targets, 3, T_SAMPLE, jnp.float64, trunc
            )
            return lp.sum() + ent.sum(), (lp, ent)

        (_, (lp_f, ent_f)), g_f = jax.jit(jax.value_and_grad(full, has_aux=True))(weight)
        (_, (lp_c, ent_c)), g_c = jax.jit(jax.value_and_grad(chunked, has_aux=True))(weight)
    np.testing.assert_allclose(np.asarray(lp_c), np.asarray(lp_f), rtol=0, atol=1e-12)
    np.testing.assert_allclose(np.asarray(ent_c), np.asarray(ent_f), rtol=0, atol=1e-12)
    assert np.all(np.isfinite(np.asarray(g_f)))
    np.testing.assert_allclose(np.asarray(g_c), np.asarray(g_f), rtol=0, atol=1e-10)


def test_settings_out_of_range_are_refused():
    for bad in ({"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2}, {"min_p": -0.1}):
        with pytest.raises(ValueError):
            Truncation(**bad)
    assert not Truncation().active and not Truncation(top_k=0).active
