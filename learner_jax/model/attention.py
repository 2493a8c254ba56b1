"""Causal self-attention over segment ids, in four interchangeable implementations.

All take q [B, T, N, H], k and v [B, S, K, H] (S == T, N a multiple of K: grouped-query
attention without repeating k/v) and `segment_ids` [B, T] (0 = padding), and return
[B, T, N, H] in the compute dtype. A query attends to keys at earlier-or-equal indices
of the same nonzero segment; scores and softmax are fp32.

- "xla": the reference. Materializes the [B, K, G, T, S] scores and probabilities, so
  activation memory grows as T^2 (4 GiB of fp32 scores per layer at T = 8k, N = 16).
- "dot_product": `jax.nn.dot_product_attention`. With `cudnn=True` (bf16/fp16 on an
  NVIDIA GPU) it is cuDNN's fused flash kernel; the boolean mask becomes one additive
  [B, 1, T, S] bias (N times smaller than the scores, and never saved as probabilities).
  Otherwise it is JAX's own XLA path, which materializes like "xla".
- "blockwise": flash-style in pure JAX. Query blocks are mapped, each scanning key
  blocks with a running max and sum (online softmax), and the per-query-block function
  is rematerialized, so forward and backward hold O(T * block) scores, not O(T^2).
  Key blocks wholly above the causal diagonal are skipped with `lax.cond`. When T fits
  one block, `attend` runs the reference instead (one tile is the whole matrix).
- "splash": the Pallas TPU flash kernel (`splash.py`): causal block sparsity, segment
  ids and GQA in the kernel, T and H padded to multiples of 128, `shard_map` under a
  mesh. Off TPU it runs in Pallas interpret mode (for tests; slow).

Padding rows (all keys masked) use the finite fill of "xla": every score is the same
finite minimum, so the row softmaxes to uniform instead of NaN. "blockwise" averages only
over the key blocks it does not skip, so padding rows' (meaningless) outputs may differ
from "xla" ("splash" attends them to earlier-or-equal padding keys of their row); they
stay finite, and nothing reads them: real tokens never attend to padding keys, and the
losses multiply padding positions by a zero mask.

"auto" picks per platform and dtype (`resolve`): splash on TPU (any dtype, any shape:
it pads), cuDNN flash for bf16/fp16 on GPU when its static shape limits hold, otherwise
"blockwise".

Einsum letters: B batch, T query time, S key time, N heads, K kv heads, G query heads per
kv head, H head dim; blocked: nb number of blocks, Q query block, C key block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from learner_jax.model import splash

IMPLEMENTATIONS = ("auto", "xla", "dot_product", "blockwise", "splash")
_FILL = float(jnp.finfo(jnp.float32).min)  # finite: a fully masked row stays NaN-free


def attention_mask(segment_ids):
    """[B, T, S] bool: key index <= query index, same nonzero segment."""
    t = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))  # [T, S]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, S]
    return causal[None] & same & (segment_ids[:, :, None] != 0)


def resolve(impl: str, dtype, head_dim: int, seq_len: int) -> str:
    """The concrete implementation for `impl` ('auto' -> a platform choice)."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"attention must be one of {IMPLEMENTATIONS}, got {impl!r}")
    if impl != "auto":
        return impl
    if jax.default_backend() == "tpu":
        return "splash"
    if _cudnn_ok(dtype, head_dim, seq_len):
        return "dot_product"
    return "blockwise"


def _cudnn_ok(dtype, head_dim: int, seq_len: int) -> bool:
    # cuDNN flash: fp16/bf16 only; head dim a multiple of 8 and <= 128 (256 from Hopper);
    # with a bias in training, even sequence lengths. Anything else: blockwise.
    return (
        jax.default_backend() == "gpu"
        and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        and head_dim % 8 == 0
        and head_dim <= 128
        and seq_len % 2 == 0
    )


def attend(q, k, v, segment_ids, impl: str = "auto", block_size: int = 512):
    """Masked causal attention, [B, T, N, H] in q's dtype (see the module docstring)."""
    name = resolve(impl, q.dtype, q.shape[-1], q.shape[1])
    # One tile covers the whole [T, S] matrix: that tile is exactly the reference math
    # (same summation order as 'xla', and no scan), at the same memory.
    if name == "xla" or (name == "blockwise" and q.shape[1] <= block_size):
        return xla_attention(q, k, v, segment_ids)
    if name == "dot_product":
        cudnn = _cudnn_ok(q.dtype, q.shape[-1], q.shape[1])
        return dot_product_attention(q, k, v, segment_ids, cudnn=cudnn)
    if name == "splash":
        return splash.splash_attention(q, k, v, segment_ids, block_size)
    return blockwise_attention(q, k, v, segment_ids, block_size)


def xla_attention(q, k, v, segment_ids):
    """The reference: full [B, K, G, T, S] scores (what the model always did)."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    mask = attention_mask(segment_ids)  # [B, T, S]
    q = q.reshape(b, t, kh, n // kh, h)  # [B, T, K, G, H]: query heads grouped by kv head
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * h**-0.5
    scores = jnp.where(mask[:, None, None], scores, _FILL)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)  # [B, K, G, T, S]
    return jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(b, t, n, h)  # [B, T, N, H]


def dot_product_attention(q, k, v, segment_ids, cudnn: bool = False):
    """`jax.nn.dot_product_attention` with the segment mask; cuDNN flash when `cudnn`."""
    mask = attention_mask(segment_ids)[:, None]  # [B, 1, T, S], broadcast over heads
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, implementation="cudnn" if cudnn else None
    )  # [B, T, N, H]


def blockwise_attention(q, k, v, segment_ids, block_size: int = 512):
    """Online-softmax attention over [Q, C] tiles; never forms a [T, S] array."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    bs = min(block_size, t)
    pad = -t % bs
    if pad:  # padded keys get segment 0 (masked); padded queries are sliced off below
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q, k, v = (jnp.pad(x, widths) for x in (q, k, v))
        segment_ids = jnp.pad(segment_ids, ((0, 0), (0, pad)))
    nb = (t + pad) // bs
    dt = q.dtype

    def blocks(x):  # [B, nb * bs, ...] -> [nb, B, bs, ...]
        return jnp.moveaxis(x.reshape(b, nb, bs, *x.shape[2:]), 1, 0)

    qb = blocks(q.reshape(b, t + pad, kh, g, h))  # [nb, B, Q, K, G, H]
    kb, vb = blocks(k), blocks(v)  # [nb, B, C, K, H]
    segb = blocks(segment_ids)  # [nb, B, Q]
    within = jnp.arange(bs)

    def q_block(xs):
        i, q_blk, q_seg = xs  # [], [B, Q, K, G, H], [B, Q]
        q_idx = i * bs + within  # [Q]

        def kv_step(carry, ys):
            j, k_blk, v_blk, k_seg = ys  # [], [B, C, K, H], [B, C, K, H], [B, C]

            def update(carry):
                acc, m, s_sum = carry  # [B, K, G, Q, H], [B, K, G, Q], [B, K, G, Q] fp32
                s = jnp.einsum(
                    "bqkgh,bckh->bkgqc", q_blk, k_blk, preferred_element_type=jnp.float32
                )
                s = s * h**-0.5  # [B, K, G, Q, C]
                k_idx = j * bs + within  # [C]
                mask = (
                    (k_idx[None, :] <= q_idx[:, None])[None]
                    & (q_seg[:, :, None] == k_seg[:, None, :])
                    & (q_seg[:, :, None] != 0)
                )  # [B, Q, C]
                s = jnp.where(mask[:, None, None], s, _FILL)
                # The output does not depend on the running max, so no gradient through it.
                m_new = jax.lax.stop_gradient(jnp.maximum(m, s.max(-1)))
                corr = jnp.exp(m - m_new)  # [B, K, G, Q]
                p = jnp.exp(s - m_new[..., None])  # [B, K, G, Q, C]
                pv = jnp.einsum(
                    "bkgqc,bckh->bkgqh", p.astype(dt), v_blk, preferred_element_type=jnp.float32
                )
                return acc * corr[..., None] + pv, m_new, s_sum * corr + p.sum(-1)

            # Keys all after the block's last query are fully masked: skip their FLOPs.
            return jax.lax.cond(j * bs > i * bs + bs - 1, lambda c: c, update, carry), None

        init = (
            jnp.zeros((b, kh, g, bs, h), jnp.float32),
            jnp.full((b, kh, g, bs), _FILL, jnp.float32),
            jnp.zeros((b, kh, g, bs), jnp.float32),
        )
        (acc, _, s_sum), _ = jax.lax.scan(kv_step, init, (jnp.arange(nb), kb, vb, segb))
        # s_sum >= 1: block 0 is never skipped and its row max contributes exp(0).
        out = (acc / s_sum[..., None]).astype(dt)  # [B, K, G, Q, H]
        return jnp.einsum("bkgqh->bqkgh", out)

    # Rematerialized per query block: the backward pass keeps only q/k/v and recomputes
    # one block's [Q, S] tiles at a time, instead of saving every tile of the forward.
    out = jax.lax.map(jax.checkpoint(q_block), (jnp.arange(nb), qb, segb))  # [nb, B, Q, K, G, H]
    out = jnp.moveaxis(out, 0, 1).reshape(b, t + pad, n, h)
    return out[:, :t]  # [B, T, N, H]
