"""The routed mixture-of-experts MLP of HF `qwen3_moe`, and its load-balancing loss.

Routing follows transformers' `Qwen3MoeTopKRouter`: router logits = x @ gate (fp32),
softmax over the E experts, the top k, renormalised to sum to 1 when `norm_topk_prob`.
Each chosen expert is a SwiGLU MLP of width I; the token's output is the routing-weighted
sum of its k experts' outputs.

Dispatch is dropless and sparse: the N*k (token, expert) pairs are sorted by expert, so
each expert's tokens are one contiguous group, and the three projections are grouped
matmuls over those groups (`grouped_matmul`) — each row meets only its own expert's
weights, never every expert. Two implementations, equal up to summation order:
- 'ragged_dot': `jax.lax.ragged_dot`, which XLA lowers to a grouped GEMM on GPU and TPU.
  On CPU, JAX lowers it by masking every group over every row (E times the FLOPs), so it
  is not used there at real shapes.
- 'blocks': the sorted rows padded per expert to whole blocks of `block` rows, so every
  block belongs to one expert; a scan multiplies each used block by its expert's weights
  (a custom VJP does the same for the backward, accumulating each expert's weight
  gradient in place). FLOPs = the routed rows plus at most E * (block - 1) padding rows.
'auto' is 'ragged_dot' on GPU/TPU and 'blocks' elsewhere.

Routing replay (R3): given the experts another engine chose for each token
(`replay` [B, T, k]), the layer routes to those instead of its own top k and weights them
with its own softmax at those ids (renormalised as above), so the gradient flows through
the learner's router into the replayed choice. The layer always reports its own top k
(`sow` into the 'moe' collection: `router_logits` [B, T, E], `own_experts` [B, T, k]), so the
caller can measure agreement with what a worker recorded.

Letters: B batch, T time, N = B*T tokens, D model, E experts, k experts a token,
I expert width, M = N*k routed rows, P padded rows.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bridge.model.config import ModelConfig

Dtype = Any
MATMULS = ("auto", "ragged_dot", "blocks")
_INIT = nn.initializers.normal(stddev=0.02)


def resolve_matmul(name: str) -> str:
    if name not in MATMULS:
        raise ValueError(f"moe matmul must be one of {MATMULS}, got {name!r}")
    if name == "auto":
        return "ragged_dot" if jax.default_backend() in ("gpu", "tpu") else "blocks"
    return name


def route(logits, k: int, norm_topk_prob: bool, replay=None):
    """(weights [..., k] fp32, expert ids [..., k] int32, own top-k ids [..., k]) from router
    logits [..., E]; with `replay` the ids are the replayed ones, weighted by this router."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    own_weights, own_ids = jax.lax.top_k(probs, k)
    if replay is None:
        weights, ids = own_weights, own_ids
    else:
        ids = jnp.asarray(replay, jnp.int32)
        weights = jnp.take_along_axis(probs, ids, axis=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights, ids, own_ids.astype(jnp.int32)


# ---------------------------------------------------------------------------- blocks


def _block_layout(sorted_ids, group_sizes, block: int, num_blocks: int):
    """Where each sorted row goes in the block-padded layout, and each block's expert.

    Returns (dest [M] row index in [P = num_blocks * block], block_expert [num_blocks],
    block_used [num_blocks] bool)."""
    padded = (group_sizes + block - 1) // block * block  # [E]
    padded_start = jnp.cumsum(padded) - padded
    group_start = jnp.cumsum(group_sizes) - group_sizes
    rank = jnp.arange(sorted_ids.shape[0], dtype=jnp.int32) - group_start[sorted_ids]
    dest = padded_start[sorted_ids] + rank
    ends = jnp.cumsum(padded)  # [E] first padded row after each expert
    starts = jnp.arange(num_blocks, dtype=jnp.int32) * block
    block_expert = jnp.searchsorted(ends, starts, side="right").astype(jnp.int32)
    used = block_expert < group_sizes.shape[0]
    return dest, jnp.minimum(block_expert, group_sizes.shape[0] - 1), used


def _blocks_fwd_impl(x, w, block_expert, used):
    """x [nb, b, K] @ w[block_expert] [nb, K, N] block by block; unused blocks are 0."""

    def body(_, xs):
        xb, e, u = xs
        yb = jax.lax.cond(
            u,
            lambda: jnp.dot(xb, w[e], preferred_element_type=jnp.float32),
            lambda: jnp.zeros((xb.shape[0], w.shape[2]), jnp.float32),
        )
        return None, yb.astype(x.dtype)

    return jax.lax.scan(body, None, (x, block_expert, used))[1]


@jax.custom_vjp
def _blocks_matmul(x, w, block_expert, used):
    return _blocks_fwd_impl(x, w, block_expert, used)


def _blocks_fwd(x, w, block_expert, used):
    return _blocks_fwd_impl(x, w, block_expert, used), (x, w, block_expert, used)


def _blocks_bwd(res, dy):
    x, w, block_expert, used = res

    def step(dw, xs):
        xb, dyb, e, u = xs

        def grad():
            dxb = jnp.dot(dyb, w[e].T, preferred_element_type=jnp.float32).astype(x.dtype)
            dwe = jnp.dot(xb.T, dyb, preferred_element_type=jnp.float32).astype(dw.dtype)
            return dw.at[e].add(dwe), dxb  # in place: dw is the scan's carry

        return jax.lax.cond(u, grad, lambda: (dw, jnp.zeros_like(xb)))

    dw, dx = jax.lax.scan(step, jnp.zeros_like(w), (x, dy, block_expert, used))
    return dx, dw, None, None


_blocks_matmul.defvjp(_blocks_fwd, _blocks_bwd)


# ---------------------------------------------------------------------------- dispatch


class Dispatch:
    """The sorted, grouped layout of one layer's routed rows, shared by its 3 matmuls."""

    def __init__(self, ids, num_experts: int, impl: str, block: int):
        flat = ids.reshape(-1)  # [M] expert of each (token, slot)
        self.k = ids.shape[-1]
        self.order = jnp.argsort(flat, stable=True)  # [M] sorted row -> (token, slot)
        self.group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
        self.impl, self.block = impl, block
        if impl == "blocks":
            m = flat.shape[0]
            self.num_blocks = -(-m // block) + min(num_experts, m)
            self.dest, self.block_expert, self.used = _block_layout(
                flat[self.order], self.group_sizes, block, self.num_blocks
            )

    def gather(self, x):
        """Token rows x [N, D] -> routed rows in this layout ([M, D] or [P, D])."""
        rows = x[self.order // self.k]
        if self.impl == "ragged_dot":
            return rows
        padded = jnp.zeros((self.num_blocks * self.block, x.shape[1]), x.dtype)
        return padded.at[self.dest].set(rows)

    def matmul(self, rows, w):
        """rows [M or P, K] @ their expert's w [E, K, N]."""
        if self.impl == "ragged_dot":
            return jax.lax.ragged_dot(
                rows, w, self.group_sizes, preferred_element_type=jnp.float32
            ).astype(rows.dtype)
        nb, b = self.num_blocks, self.block
        out = _blocks_matmul(rows.reshape(nb, b, -1), w, self.block_expert, self.used)
        return out.reshape(nb * b, -1)

    def combine(self, rows, weights):
        """Routed rows back to tokens: sum over each token's k rows, weighted [N, k]."""
        if self.impl == "blocks":
            rows = rows[self.dest]  # [M, D] in sorted order
        n = weights.shape[0]
        unsorted = jnp.zeros_like(rows).at[self.order].set(rows).reshape(n, self.k, -1)
        return jnp.einsum(
            "nkd,nk->nd", unsorted, weights.astype(rows.dtype), preferred_element_type=jnp.float32
        )


def grouped_matmul(x, w, ids, impl: str = "auto", block: int = 64):
    """Row r of x [M, K] times w[ids[r]] ([E, K, N]) for every r: [M, N] (for tests and
    the bench; the layer shares one `Dispatch` between its projections)."""
    d = Dispatch(ids[:, None], w.shape[0], resolve_matmul(impl), block)
    rows = d.matmul(d.gather(x), w)
    if d.impl == "blocks":
        rows = rows[d.dest]
    return jnp.zeros_like(rows).at[d.order].set(rows)


# ---------------------------------------------------------------------------- the layer


class SparseMoE(nn.Module):
    """x [B, T, D] -> [B, T, D]; parameters `gate/kernel` [D, E] and
    `experts/{gate,up,down}_proj` ([E, D, I], [E, D, I], [E, I, D])."""

    cfg: ModelConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    matmul: str = "auto"
    block: int = 64

    @nn.compact
    def __call__(self, x, replay=None):
        cfg, dt, pdt = self.cfg, self.dtype, self.param_dtype
        d, e, i, k = (
            cfg.hidden_size,
            cfg.num_experts,
            cfg.moe_intermediate_size,
            cfg.num_experts_per_tok,
        )
        b, t = x.shape[:2]
        router = Router(d, e, pdt, name="gate")
        logits = router(x)  # [B, T, E] fp32
        if replay is not None and replay.shape != (b, t, k):
            raise ValueError(f"replayed experts have shape {replay.shape}, expected {(b, t, k)}")
        weights, ids, own = route(logits, k, cfg.norm_topk_prob, replay)
        self.sow("moe", "router_logits", logits)
        self.sow("moe", "own_experts", own)
        experts = Experts(e, d, i, pdt, name="experts")
        w_gate, w_up, w_down = (jnp.asarray(w, dt) for w in experts())
        n = b * t
        dispatch = Dispatch(ids.reshape(n, k), e, resolve_matmul(self.matmul), self.block)
        rows = dispatch.gather(x.reshape(n, d).astype(dt))
        hidden = jax.nn.silu(dispatch.matmul(rows, w_gate)) * dispatch.matmul(rows, w_up)
        out = dispatch.combine(dispatch.matmul(hidden, w_down), weights.reshape(n, k))
        return out.astype(dt).reshape(b, t, d)


class Router(nn.Module):
    features: int
    num_experts: int
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        kernel = self.param(
            "kernel",
            nn.with_logical_partitioning(_INIT, ("embed", None)),
            (self.features, self.num_experts),
            self.param_dtype,
        )
        # fp32 logits: the top-k choice is discontinuous, keep it off bf16 rounding.
        return jnp.einsum("btd,de->bte", x.astype(jnp.float32), kernel.astype(jnp.float32))


class Experts(nn.Module):
    num_experts: int
    features: int
    width: int
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self):
        e, d, i = self.num_experts, self.features, self.width

        def p(name, shape, names):
            return self.param(
                name, nn.with_logical_partitioning(_INIT, names), shape, self.param_dtype
            )

        return (
            p("gate_proj", (e, d, i), ("expert", "embed", "mlp")),
            p("up_proj", (e, d, i), ("expert", "embed", "mlp")),
            p("down_proj", (e, i, d), ("expert", "mlp", "embed")),
        )


# ---------------------------------------------------------------------------- aux loss


def load_balancing_loss(router_logits, mask, k: int):
    """transformers' `load_balancing_loss_func` (qwen3_moe, v5) over all MoE layers at once.

    router_logits [L, N, E] (one row per token of each MoE layer), mask [N] (1 = a real
    token). With f_e = (k-slot selections of expert e, summed over layers and real tokens)
    / (L * real tokens) and P_e = (its softmax probability summed likewise) / (same), the
    loss is E * sum_e f_e P_e; gradient through P only (the selection is a count).
    """
    num_layers, _, e = router_logits.shape
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)  # [L, N, E]
    _, chosen = jax.lax.top_k(probs, k)  # [L, N, k]
    m = mask.astype(jnp.float32)
    counts = (jax.nn.one_hot(chosen, e, dtype=jnp.float32) * m[None, :, None, None]).sum(
        axis=(0, 1, 2)
    )  # [E]
    prob_sum = (probs * m[None, :, None]).sum(axis=(0, 1))  # [E]
    rows = num_layers * m.sum()
    return e * jnp.sum((counts / rows) * (prob_sum / rows))


def routing_agreement(own, recorded):
    """Per token and layer, the fraction of the recorded k experts the learner's own top k
    also chose (order-free): own, recorded [..., k] -> [...] in [0, 1]."""
    hit = (own[..., :, None] == recorded[..., None, :].astype(own.dtype)).any(axis=-1)
    return hit.astype(jnp.float32).mean(axis=-1)
