"""The attention implementations against the reference on raw q/k/v: causal + padding +
packed segments with GQA, gradients, and that 'blockwise' never forms a [T, S] array."""

import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from float_tolerance import assert_close_at_scale

from learner_jax.model import attention

B, T, N, K, H = 4, 37, 8, 2, 16  # GQA: 4 query heads per kv head; T not a block multiple


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, N, H)).astype(np.float32) * 2
    k = rng.standard_normal((B, T, K, H)).astype(np.float32) * 2
    v = rng.standard_normal((B, T, K, H)).astype(np.float32)
    seg = np.ones((B, T), np.int32)
    seg[0, :9] = 0  # left padded
    seg[1, 25:] = 0  # right padded
    seg[2, 12:30], seg[2, 30:] = 2, 3  # three packed sequences
    seg[3] = 0  # all padding
    return q, k, v, seg


def impls():
    return {
        "dot_product": attention.dot_product_attention,
        "blockwise_8": lambda *a: attention.blockwise_attention(*a, block_size=8),
        "blockwise_16": lambda *a: attention.blockwise_attention(*a, block_size=16),
        "blockwise_64": lambda *a: attention.blockwise_attention(*a, block_size=64),
        "auto": lambda *a: attention.attend(*a, impl="auto"),
    }


@pytest.mark.parametrize("name", sorted(impls()))
def test_outputs_and_gradients_match_reference(name):
    q, k, v, seg = inputs()
    real = seg > 0
    w = np.random.default_rng(1).standard_normal((B, T, N, H)).astype(np.float32)
    w *= real[..., None, None]  # losses never read padding positions

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda q, k, v: (fn(q, k, v, seg) * w).sum(), (0, 1, 2)))

    ref = attention.xla_attention(q, k, v, seg)
    out = jax.jit(impls()[name])(q, k, v, seg)
    assert out.shape == (B, T, N, H) and out.dtype == jnp.float32
    assert np.isfinite(np.asarray(out)).all()  # the all-padding row too
    assert_close_at_scale(np.asarray(out)[real], np.asarray(ref)[real])
    (l_ref, g_ref), (l_out, g_out) = (
        loss(attention.xla_attention)(q, k, v),
        loss(impls()[name])(q, k, v),
    )
    # The loss sums ~B*T*N*H terms of random sign: its rounding is of the size of their l2
    # norm (a random walk), not of the (cancelling) result.
    terms = np.asarray(ref) * w
    assert_close_at_scale(l_out, l_ref, scale=np.sqrt((terms**2).sum()), err_msg="loss")
    for a, b in zip(g_out, g_ref, strict=True):
        assert np.isfinite(np.asarray(a)).all()
        assert_close_at_scale(a, b, err_msg=name)


def test_bf16_blockwise_close_to_reference():
    q, k, v, seg = (x.astype(jnp.bfloat16) if x.dtype == np.float32 else x for x in inputs())
    real = seg > 0
    ref = np.asarray(attention.xla_attention(q, k, v, seg), np.float32)
    out = np.asarray(attention.blockwise_attention(q, k, v, seg, block_size=8), np.float32)
    assert np.abs(out - ref)[real].max() < 0.05 * ref[real].std()


def _largest_intermediate(fn, *args) -> int:
    """Elements of the largest array in fn's jaxpr, sub-jaxprs (scan, cond, remat) included."""
    biggest = 0

    def walk(jaxpr):
        nonlocal biggest
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                biggest = max(biggest, math.prod(getattr(var.aval, "shape", ())))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return biggest


def test_blockwise_never_materializes_scores():
    """Forward + backward of 'blockwise' at T = 512, block 64: the largest array is one
    query block's row of tiles, [N, Q, S] (the backward recomputes one block at a time),
    T / Q = 8 times smaller than the reference's [N, T, S] scores."""
    t, blk = 512, 64
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, t, N, H)), jnp.float32)
    k = v = jnp.asarray(rng.standard_normal((1, t, K, H)), jnp.float32)
    seg = jnp.ones((1, t), jnp.int32)

    def grad_of(fn):
        return jax.grad(lambda q, k, v: fn(q, k, v, seg).sum(), (0, 1, 2))

    blockwise = grad_of(lambda *a: attention.blockwise_attention(*a, block_size=blk))
    assert _largest_intermediate(blockwise, q, k, v) <= N * blk * t
    assert _largest_intermediate(grad_of(attention.xla_attention), q, k, v) >= N * t * t


def test_resolve():
    assert attention.resolve("xla", jnp.float32, 128, 64) == "xla"
    on_cpu = jax.default_backend() == "cpu"
    assert not on_cpu or attention.resolve("auto", jnp.bfloat16, 128, 64) == "blockwise"
    with pytest.raises(ValueError, match="attention must be"):
        attention.resolve("flash", jnp.float32, 128, 64)
