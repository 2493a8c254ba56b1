"""Chunked log-probs (`learner_jax/model/logprobs.py`) equal the full-logits path, values and
gradients.

Compared in float64 (`enable_x64`), where both paths are exact to ~1e-15 relative, so a
1e-10 tolerance holds on any CPU and still catches any real difference: a dropped chunk,
a padded tail that leaks into the result, a wrong temperature, a head transposed, or a
checkpoint that drops the gradient of the unembedding.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import enable_x64

from learner_jax.model import logprobs

B, T, D, V = 2, 13, 8, 37


def _inputs(tied: bool):
    rng = np.random.default_rng(0)
    hidden = jnp.asarray(rng.normal(size=(B, T, D)))
    weight = jnp.asarray(rng.normal(size=(V, D) if tied else (D, V)))
    targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
    coef = jnp.asarray(rng.normal(size=(3, B, T)))  # weights every output of every token
    return hidden, weight, targets, coef


def _full(hidden, weight, eqn, targets, temperature):
    logits = jnp.einsum(eqn.replace("c", "t"), hidden, weight)
    return logprobs.token_stats(logits, targets, temperature)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("chunk,temperature", [(4, 1.0), (5, 0.7), (13, 1.0), (64, 1.3)])
def test_chunked_equals_full_values_and_gradients(tied, chunk, temperature):
    with enable_x64():
        hidden, weight, targets, coef = _inputs(tied)
        eqn = "bcd,vd->bcv" if tied else "bcd,dv->bcv"

        def chunked(h, w):
            return logprobs.chunked_token_stats(
                h, w, eqn, targets, chunk, temperature, dtype=jnp.float64
            )

        def full(h, w):
            return _full(h, w, eqn, targets, temperature)

        got, want = chunked(hidden, weight), full(hidden, weight)
        assert got[0].dtype == got[1].dtype == jnp.float64  # no silent fp32 on the way
        for g, w in zip(got, want, strict=True):
            assert g.shape == (B, T)
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)

        def scalar(fn):  # logp and entropy both carry gradients; argmax hits do not
            return lambda h, w: sum(
                (c * o).sum() for c, o in zip(coef[:2], fn(h, w)[:2], strict=True)
            )

        g_got = jax.grad(scalar(chunked), argnums=(0, 1))(hidden, weight)
        g_want = jax.grad(scalar(full), argnums=(0, 1))(hidden, weight)
        for g, w in zip(g_got, g_want, strict=True):
            assert float(jnp.abs(w).max()) > 1e-3  # the reference gradient is not trivially 0
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


def test_head_weight_reads_boxed_and_plain_trees():
    w = jnp.ones((V, D))
    assert logprobs.head_weight({"embed": {"embedding": w}}, tied=True)[1] == "bcd,vd->bcv"
    k = jnp.ones((D, V))
    got, eqn = logprobs.head_weight({"lm_head": {"kernel": k}}, tied=False)
    assert got.shape == (D, V) and eqn == "bcd,dv->bcv"


def test_bad_chunk_is_refused():
    hidden, weight, targets, _ = _inputs(True)
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        logprobs.chunked_token_stats(hidden, weight, "bcd,vd->bcv", targets, 0)
