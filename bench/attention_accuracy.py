"""How far each attention implementation (learner_jax/model/attention.py) lands from exact
attention: outputs and the gradients of a fixed random projection of them, on one row of
two packed causal segments with the model's grouped-query heads.

References: float64 numpy (`numpy_attention`, forward and backward written out, no JAX)
where T is small enough for the host, and always the "xla" path in float32 at the highest
matmul precision (no TF32), on the same (bfloat16-representable) inputs. The fp32 path is
itself compared with float64 where both exist, so a bf16 arm's error against it is the
arm's own.

Error of an arm: max over (out, dq, dk, dv) of max|arm - ref| / max|ref|, each tensor at
its own scale (an elementwise relative error is meaningless where a value crosses zero).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from learner_jax.model import attention, splash

TENSORS = ("out", "dq", "dk", "dv")


def inputs(t: int, n: int, kh: int, h: int, seed: int = 0) -> dict[str, np.ndarray]:
    """q [1, T, N, H], k, v [1, T, K, H] (bf16-representable float32), segments [1, T] (the
    last quarter a second packed sequence) and the projection w [1, T, N, H]."""
    rng = np.random.default_rng(seed)

    def bf16_values(shape):
        return np.asarray(jnp.asarray(rng.standard_normal(shape), jnp.bfloat16), np.float32)

    seg = np.ones((1, t), np.int32)
    seg[:, t - t // 4 :] = 2
    return {
        "q": bf16_values((1, t, n, h)),
        "k": bf16_values((1, t, kh, h)),
        "v": bf16_values((1, t, kh, h)),
        "seg": seg,
        "w": rng.standard_normal((1, t, n, h)).astype(np.float32),
    }


def numpy_attention(q, k, v, seg, w) -> dict[str, np.ndarray]:
    """Exact attention in float64: out and d(sum(out * w)) / d(q, k, v)."""
    q, k, v, w = (np.asarray(x, np.float64) for x in (q, k, v, w))
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    scale = h**-0.5
    qg, wg = q.reshape(b, t, kh, g, h), w.reshape(b, t, kh, g, h)  # [B, T, K, G, H]
    causal = np.tril(np.ones((t, t), bool))
    mask = causal[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)
    s = np.einsum("btkgh,bskh->bkgts", qg, k, optimize=True) * scale
    s = np.where(mask[:, None, None], s, -np.inf)  # every row keeps its diagonal
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)  # [B, K, G, T, S]
    out = np.einsum("bkgts,bskh->btkgh", p, v, optimize=True)
    dv = np.einsum("bkgts,btkgh->bskh", p, wg, optimize=True)
    dp = np.einsum("btkgh,bskh->bkgts", wg, v, optimize=True)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))  # softmax backward
    dq = np.einsum("bkgts,bskh->btkgh", ds, k, optimize=True) * scale
    dk = np.einsum("bkgts,btkgh->bskh", ds, qg, optimize=True) * scale
    return {"out": out.reshape(b, t, n, h), "dq": dq.reshape(b, t, n, h), "dk": dk, "dv": dv}


def arms() -> dict:
    """name -> (attention fn(q, k, v, seg), compute dtype) for this platform, or the reason
    the arm cannot run here."""
    platform = jax.default_backend()
    out = {
        "xla_fp32": (attention.xla_attention, jnp.float32),
        "xla_bf16": (attention.xla_attention, jnp.bfloat16),
        "blockwise_bf16": (attention.blockwise_attention, jnp.bfloat16),
    }
    if platform == "gpu":
        out["cudnn_bf16"] = (
            lambda q, k, v, s: attention.dot_product_attention(q, k, v, s, cudnn=True),
            jnp.bfloat16,
        )
    else:
        out["cudnn_bf16"] = f"cuDNN needs an NVIDIA GPU; this backend is {platform}"
    if platform == "tpu":
        out["splash_bf16"] = (splash.splash_attention, jnp.bfloat16)
    return out


def _value_and_grads(fn, dtype):
    """x -> {out, dq, dk, dv}: one jitted forward + backward of sum(out * w) in `dtype`."""

    def loss(q, k, v, seg, w):
        out = fn(q, k, v, seg)
        return (out.astype(jnp.float32) * w).sum(), out

    vg = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

    def run(x):
        q, k, v = (jnp.asarray(x[n], dtype) for n in "qkv")
        (_, out), (dq, dk, dv) = vg(q, k, v, x["seg"], x["w"])
        return {"out": out, "dq": dq, "dk": dk, "dv": dv}

    return run


def rel_err(got: dict, ref: dict) -> float:
    errs = []
    for name in TENSORS:
        a, b = np.asarray(got[name], np.float64), np.asarray(ref[name], np.float64)
        errs.append(float(np.abs(a - b).max() / np.abs(b).max()))
    return max(errs)


def compare(t: int, n: int, kh: int, h: int, numpy_max_len: int, reps: int = 3) -> list[dict]:
    """One row per arm at length t: its error against the fp32 reference (and against
    float64 where t <= numpy_max_len) and its median forward + backward time."""
    x = inputs(t, n, kh, h)
    with jax.default_matmul_precision("highest"):
        ref = jax.device_get(_value_and_grads(attention.xla_attention, jnp.float32)(x))
    exact = numpy_attention(**x) if t <= numpy_max_len else None
    rows = []
    for name, arm in arms().items():
        row = {"kind": "attention", "arm": name, "seq_len": t}
        if isinstance(arm, str):
            rows.append({**row, "skipped": arm})
            continue
        run = _value_and_grads(*arm)
        try:
            got = jax.device_get(run(x))  # compiles
        except Exception as e:  # an arm this runtime rejects is a result, not a crash
            rows.append({**row, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(run(x))
            times.append(time.perf_counter() - t0)
        row.update(
            max_rel_err=rel_err(got, ref),
            max_rel_err_vs_float64=None if exact is None else rel_err(got, exact),
            fwd_bwd_ms=1e3 * statistics.median(times),
        )
        rows.append(row)
    if exact is not None:
        rows.append(
            {"kind": "attention", "arm": "reference_fp32", "seq_len": t,
             "max_rel_err_vs_float64": rel_err(ref, exact)}
        )  # fmt: skip
    return rows
