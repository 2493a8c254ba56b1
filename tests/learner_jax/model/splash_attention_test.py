"""Splash attention (Pallas interpret mode on CPU) and the cuDNN path (GPU only) against
the "xla" reference: causal + padding + packed segments with GQA, outputs and q/k/v
gradients; splash under a (data, fsdp, tensor) mesh through its shard_map."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from float_tolerance import EPS32, assert_close_at_scale, assert_trees_close_at_scale

from bridge.model import tiny_model
from learner_jax.model import attention, model, sharding, splash

# GQA (2 query heads per kv head); T = 200 pads to 256 = two 128-blocks, H = 16 to 128.
B, T, N, K, H = 4, 200, 4, 2, 16
BLOCK = 128


def inputs(seed=0, dtype=np.float32, b=B, t=T, n=N, k=K, h=H):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, n, h)) * 2
    kk = rng.standard_normal((b, t, k, h)) * 2
    v = rng.standard_normal((b, t, k, h))
    seg = np.ones((b, t), np.int32)
    seg[0, :70] = 0  # left padded
    seg[1, 150:] = 0  # right padded
    seg[2, 100:180], seg[2, 180:] = 2, 3  # packed; segment 2 crosses the block boundary
    seg[3 % b] = 0  # all padding
    return (*(x.astype(dtype) for x in (q, kk, v)), seg)


def loss_and_grads(fn, q, k, v, seg, w):
    """(sum(out * w), d/dq, d/dk, d/dv): w is zero on padding rows, as the losses are."""
    f = lambda q, k, v: (fn(q, k, v, seg).astype(jnp.float32) * w).sum()
    return jax.jit(jax.value_and_grad(f, (0, 1, 2)))(q, k, v)


def _splash(q, k, v, seg):
    return splash.splash_attention(q, k, v, seg, block_size=BLOCK, interpret=True)


def test_splash_matches_reference_in_interpret_mode():
    q, k, v, seg = inputs()
    real = seg > 0
    w = np.random.default_rng(1).standard_normal(q.shape).astype(np.float32)
    w *= real[..., None, None]

    ref = attention.xla_attention(q, k, v, seg)
    out = jax.jit(_splash)(q, k, v, seg)
    assert out.shape == (B, T, N, H) and out.dtype == jnp.float32
    assert np.isfinite(np.asarray(out)).all()  # padding rows too, the all-padding row too
    assert_close_at_scale(np.asarray(out)[real], np.asarray(ref)[real], err_msg="output")

    (l_ref, g_ref), (l_out, g_out) = (
        loss_and_grads(attention.xla_attention, q, k, v, seg, w),
        loss_and_grads(_splash, q, k, v, seg, w),
    )
    terms = np.asarray(ref) * w  # random-sign terms: rounding at their l2 norm
    assert_close_at_scale(l_out, l_ref, scale=np.sqrt((terms**2).sum()), err_msg="loss")
    for name, a, b in zip("qkv", g_out, g_ref, strict=True):
        assert np.isfinite(np.asarray(a)).all()
        assert_close_at_scale(a, b, err_msg=f"d{name}")


def test_attend_dispatches_splash_and_auto_picks_it_on_tpu(monkeypatch):
    q, k, v, seg = inputs(b=3, t=40)  # one block; H padded to 128
    real = seg > 0
    ref = np.asarray(attention.xla_attention(q, k, v, seg))
    out = np.asarray(jax.jit(lambda *a: attention.attend(*a, impl="splash"))(q, k, v, seg))
    assert np.isfinite(out).all()
    assert_close_at_scale(out[real], ref[real])
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    for dtype in (jnp.float32, jnp.bfloat16):
        assert attention.resolve("auto", dtype, 64, 1000) == "splash"


def test_splash_under_a_mesh_shards_batch_and_heads():
    """(data 2, fsdp 2, tensor 2): batch over data x fsdp, heads over tensor (N = 4 and
    K = 2 both divide), so each device runs the kernel on 1 row and 2 query heads."""
    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    q, k, v, seg = inputs(seed=2)
    real = seg > 0
    ref = np.asarray(attention.xla_attention(q, k, v, seg))
    with sharding.use_mesh(mesh):
        assert splash._mesh_axes(jax.sharding.get_abstract_mesh(), B, N, K) == (
            ("data", "fsdp"),
            ("tensor",),
        )
        assert "shard_map" in str(jax.make_jaxpr(_splash)(q, k, v, seg))
        out = jax.jit(_splash)(q, k, v, seg)
    assert np.isfinite(np.asarray(out)).all()
    assert_close_at_scale(np.asarray(out)[real], ref[real])


def test_model_parameter_gradients_with_splash():
    """The tiny Qwen3 (2 layers, GQA 4/2, head dim 32, qk-norm) with attention='splash':
    masked next-token NLL and its parameter gradients equal 'xla''s, leaf by leaf."""
    cfg = tiny_model.tiny_config("qwen3")
    params = model.init_params(cfg, jax.random.key(0))
    params = jax.tree.map(lambda p: p * 10 if p.ndim > 1 else p, params)  # std 0.2
    t = 150  # two 128-blocks after padding
    seg = inputs(b=4, t=t)[3]  # left padded, packed, all padding
    seg[1, 40:] = 2  # row 1 packed: segment 2 crosses the block boundary
    tokens = np.random.default_rng(3).integers(3, cfg.vocab_size, (4, t)).astype(np.int32)
    pos = model.positions_from_segments(jnp.asarray(seg))
    targets = np.roll(tokens, -1, axis=1)
    weight = (seg > 0) & (np.roll(seg, -1, axis=1) > 0)

    def loss_grads(opts):
        def loss(p):
            logp = model.forward_logprobs(p, cfg, tokens, pos, seg, targets, options=opts)
            return -(logp * weight).sum() / weight.sum()

        return jax.device_get(jax.jit(jax.value_and_grad(loss))(params))

    l_ref, g_ref = loss_grads(model.ModelOptions(attention="xla"))
    l_out, g_out = loss_grads(model.ModelOptions(attention="splash", attention_block=BLOCK))
    assert_close_at_scale(l_out, l_ref)
    assert_trees_close_at_scale(g_out, g_ref)


# ---- cuDNN (GPU only) -------------------------------------------------------------------

# tests/conftest.py defaults JAX_PLATFORMS to cpu: run these with JAX_PLATFORMS=cuda,cpu.
needs_gpu = pytest.mark.skipif(
    jax.default_backend() != "gpu", reason="needs a CUDA GPU (and JAX_PLATFORMS=cuda,cpu)"
)
BF16_EPS = float(jnp.finfo(jnp.bfloat16).eps)  # 7.8e-3


@pytest.mark.gpu
@needs_gpu
def test_cudnn_matches_reference_on_gpu():
    """bf16 q/k/v, head dim 128: "auto" is cuDNN flash (its custom call is in the HLO),
    compared with "xla" on the same bf16 inputs in fp32. cuDNN rounds the probabilities
    to bf16 before P.V, so outputs land within a few bf16 eps of max |v| and gradients
    within a few of their own max; a wrong mask is off by O(1)."""
    b, t, n, k, h = 4, 256, 8, 2, 128
    q, kk, v, seg = inputs(dtype=jnp.bfloat16, b=b, t=t, n=n, k=k, h=h)
    q, kk, v = (jnp.asarray(x) for x in (q, kk, v))
    real = seg > 0
    assert attention.resolve("auto", jnp.bfloat16, h, t) == "dot_product"
    auto = lambda *a: attention.attend(*a, impl="auto")
    assert "__cudnn$fmha" in jax.jit(auto).lower(q, kk, v, seg).compile().as_text()

    up = lambda x: x.astype(jnp.float32)
    with jax.default_matmul_precision("highest"):  # no TF32 in the reference
        ref = np.asarray(attention.xla_attention(up(q), up(kk), up(v), seg))
    out = np.asarray(jax.jit(auto)(q, kk, v, seg), np.float32)
    assert np.isfinite(out).all()
    assert_close_at_scale(
        out[real], ref[real], scale=np.abs(np.asarray(up(v))).max(), ulps=4 * BF16_EPS / EPS32
    )

    w = np.random.default_rng(1).standard_normal(q.shape).astype(np.float32)
    w *= real[..., None, None]
    with jax.default_matmul_precision("highest"):
        _, g_ref = loss_and_grads(attention.xla_attention, up(q), up(kk), up(v), seg, w)
    _, g_out = loss_and_grads(auto, q, kk, v, seg, w)
    for name, a, r in zip("qkv", g_out, g_ref, strict=True):
        a = np.asarray(a, np.float32)
        assert np.isfinite(a).all()
        assert_close_at_scale(a, r, ulps=8 * BF16_EPS / EPS32, err_msg=f"d{name}")


@pytest.mark.gpu
@needs_gpu
def test_fp32_dot_product_matches_reference_on_gpu():
    """fp32 on GPU is not cuDNN (resolve gives blockwise); the explicit 'dot_product' is
    JAX's XLA path there, and matches the reference at fp32 rounding (TF32 off)."""
    q, k, v, seg = inputs()
    real = seg > 0
    assert attention.resolve("auto", jnp.float32, H, T) == "blockwise"
    with jax.default_matmul_precision("highest"):
        ref = np.asarray(attention.xla_attention(q, k, v, seg))
        out = np.asarray(jax.jit(attention.dot_product_attention)(q, k, v, seg))
    assert np.isfinite(out).all()
    assert_close_at_scale(out[real], ref[real])
