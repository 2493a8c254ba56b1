"""The policy model: one Flax decoder for HF Qwen3, Qwen2, Llama and Qwen3-MoE causal LMs.

Built from `bridge.model.config.ModelConfig`; the parameter tree and its logical axis
names are the ones fixed in the `bridge/model/layouts.py` docstring, so HF checkpoints map onto
it row by row. Numerics follow transformers: RMSNorm and softmax in fp32, RoPE with HF's
rotate_half convention (the two halves of a head, not interleaved pairs), SwiGLU MLP,
grouped-query attention. One departure: RMSNorm multiplies by its scale in fp32 before
casting back, where HF casts first; identical in fp32, within bf16 rounding otherwise.

Einsum letters: B batch, T query time, S key time, D model, N heads, K kv heads,
G query heads per kv head, H head dim, F mlp, V vocab.

Sequences are packed or padded with `segment_ids` (0 = padding): a token attends to
earlier-or-equal indices of the same nonzero segment. Padding rows attend to nothing; a
finite mask value keeps them NaN-free (their outputs are meaningless, mask them out).

`ModelOptions` chooses how, not what, the model computes: the attention implementation
(`attention.py`; all agree within fp32 rounding), per-layer rematerialization
(`nn.remat` on each decoder layer: the parameter tree is unchanged, activations inside a
layer are recomputed in the backward pass instead of stored) and whether per-token
log-probs come from the full [B, T, V] logits or chunk by chunk (`logprobs.py`).

Qwen3-MoE: the layers `cfg.is_moe_layer` names have the routed experts (`moe.py`) in place
of the MLP. `routing` [B, T, L, k] (L = len(cfg.moe_layers)) replays recorded experts
(routing replay); `token_stats_and_routing` also returns the router logits and the
learner's own top-k experts per MoE layer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from bridge.model.config import ModelConfig
from learner_jax import lora as lora_lib
from learner_jax.model import attention, logprobs, moe
from learner_jax.model import truncation as truncation_lib
from learner_jax.model.attention import attention_mask  # noqa: F401  (public, re-exported)
from learner_jax.model.truncation import Truncation

Dtype = Any
_INIT = nn.initializers.normal(stddev=0.02)
REMAT = ("none", "full")  # or the name of any `jax.checkpoint_policies` policy


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """How the model computes (never which parameters it has).

    attention: 'auto' | 'xla' | 'dot_product' | 'blockwise' (see attention.py).
    remat: 'none' | 'full' (save only each layer's input) | a `jax.checkpoint_policies`
      name such as 'dots_saveable' or 'nothing_saveable'.
    attention_block: query/key block size of 'blockwise'.
    logprob_chunk: tokens per chunk of the unembedding + log-softmax in `token_stats`
      (0 = the full [B, T, V] logits at once; see logprobs.py).
    """

    attention: str = "auto"
    remat: str = "none"
    attention_block: int = 512
    logprob_chunk: int = 0
    moe_matmul: str = "auto"  # the experts' grouped matmul (moe.py: auto|ragged_dot|blocks)
    moe_block: int = 64  # rows per block of moe_matmul='blocks'

    def __post_init__(self):
        if self.attention not in attention.IMPLEMENTATIONS:
            raise ValueError(
                f"attention must be one of {attention.IMPLEMENTATIONS}, got {self.attention!r}"
            )
        if self.remat not in REMAT and not hasattr(jax.checkpoint_policies, self.remat):
            raise ValueError(f"remat must be {REMAT} or a jax.checkpoint_policies name")
        if self.attention_block < 1:
            raise ValueError(f"attention_block must be >= 1, got {self.attention_block}")
        if self.logprob_chunk < 0:
            raise ValueError(f"logprob_chunk must be >= 0 (0 = off), got {self.logprob_chunk}")
        if self.moe_matmul not in moe.MATMULS:  # resolved at the call: a default instance
            # is built at import, before jax.distributed.initialize may touch the backend
            raise ValueError(f"moe_matmul must be one of {moe.MATMULS}, got {self.moe_matmul!r}")
        if self.moe_block < 1:
            raise ValueError(f"moe_block must be >= 1, got {self.moe_block}")

    def block_class(self):
        """The decoder layer class, wrapped in `nn.remat` as `remat` asks."""
        if self.remat == "none":
            return Block
        policy = None if self.remat == "full" else getattr(jax.checkpoint_policies, self.remat)
        return nn.remat(Block, policy=policy)


def _param(module: nn.Module, name: str, init, shape, names, dtype):
    return module.param(name, nn.with_logical_partitioning(init, names), shape, dtype)


class RMSNorm(nn.Module):
    axis_name: str  # logical axis of the scale: 'embed' or 'kv' (per-head q/k norm)
    eps: float
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x):
        scale = _param(
            self, "scale", nn.initializers.ones, (x.shape[-1],), (self.axis_name,), self.param_dtype
        )
        x = x.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (x * scale.astype(jnp.float32)).astype(self.dtype)


class Linear(nn.Module):
    """`einsum(eqn, x, kernel)` (+ bias over the output axes); kernel [in..., out...]."""

    eqn: str
    shape: tuple[int, ...]
    names: tuple[str, ...]
    use_bias: bool = False
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    accum_dtype: Dtype | None = None  # fp32 for the output head, so bf16 logits stay exact
    lora: lora_lib.LoraConfig | None = None  # adapters when this module's name is a target

    @nn.compact
    def __call__(self, x):
        kernel = _param(self, "kernel", _INIT, self.shape, self.names, self.param_dtype)
        y = jnp.einsum(
            self.eqn,
            x.astype(self.dtype),
            kernel.astype(self.dtype),
            preferred_element_type=self.accum_dtype,
        )
        if self.use_bias:  # q/k/v projections only: bias over (heads, head_dim)
            bias = _param(
                self,
                "bias",
                nn.initializers.zeros,
                self.shape[1:],
                self.names[1:],
                self.param_dtype,
            )
            y = y + bias.astype(self.dtype)
        if self.lora is not None and self.name in self.lora.module_names:
            y = y + lora_lib.adapter_delta(
                self, x, self.eqn, self.shape, self.names, self.lora, self.dtype, self.param_dtype
            )
        return y


class Embed(nn.Module):
    vocab_size: int
    features: int
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32

    def setup(self):
        self.embedding = _param(
            self,
            "embedding",
            _INIT,
            (self.vocab_size, self.features),
            ("vocab", "embed"),
            self.param_dtype,
        )

    def __call__(self, tokens):
        # FSDP-gather the model dim first so the lookup partitions cleanly over the batch.
        table = nn.with_logical_constraint(self.embedding, ("vocab", None))
        return jnp.take(table, tokens, axis=0).astype(self.dtype)  # [B, T, D]

    def attend(self, x):
        """Tied output head: logits = x @ embedding.T, accumulated in fp32."""
        return jnp.einsum(
            "btd,vd->btv",
            x,
            self.embedding.astype(self.dtype),
            preferred_element_type=jnp.float32,
        )


def apply_rope(x, positions, theta: float):
    """Rotary embedding on x [B, T, heads, H] at positions [B, T], HF rotate_half layout."""
    h = x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)  # [H/2]
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, H/2]
    sin, cos = jnp.sin(angles)[:, :, None, :], jnp.cos(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nn.Module):
    cfg: ModelConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    options: ModelOptions = ModelOptions()
    lora: lora_lib.LoraConfig | None = None

    @nn.compact
    def __call__(self, x, positions, segment_ids):
        cfg, dt, pdt = self.cfg, self.dtype, self.param_dtype
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

        def proj(name, heads, axis):
            return Linear(
                "btd,dnh->btnh",
                (d, heads, h),
                ("embed", axis, "kv"),
                cfg.attention_bias,
                dt,
                pdt,
                lora=self.lora,
                name=name,
            )(x)

        q = proj("q_proj", n, "heads")  # [B, T, N, H]
        key = proj("k_proj", k, "kv_heads")  # [B, S, K, H]
        v = proj("v_proj", k, "kv_heads")  # [B, S, K, H]
        if cfg.qk_norm:  # Qwen3: per-head RMSNorm before RoPE
            q = RMSNorm("kv", cfg.rms_norm_eps, dt, pdt, name="q_norm")(q)
            key = RMSNorm("kv", cfg.rms_norm_eps, dt, pdt, name="k_norm")(key)
        q = apply_rope(q, positions, cfg.rope_theta)
        key = apply_rope(key, positions, cfg.rope_theta)
        q = nn.with_logical_constraint(q, ("batch", "length", "act_heads", None))

        opts = self.options
        out = attention.attend(q, key, v, segment_ids, opts.attention, opts.attention_block)
        out = nn.with_logical_constraint(out, ("batch", "length", "act_heads", None))
        return Linear(
            "btnh,nhd->btd",
            (n, h, d),
            ("heads", "kv", "embed"),
            False,
            dt,
            pdt,
            lora=self.lora,
            name="o_proj",
        )(out)  # [B, T, D]


class MLP(nn.Module):
    cfg: ModelConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    lora: lora_lib.LoraConfig | None = None

    @nn.compact
    def __call__(self, x):
        cfg, dt, pdt = self.cfg, self.dtype, self.param_dtype
        d, f = cfg.hidden_size, cfg.intermediate_size

        def dense(name, eqn, shape, names):
            return Linear(eqn, shape, names, False, dt, pdt, lora=self.lora, name=name)

        gate = dense("gate_proj", "btd,df->btf", (d, f), ("embed", "mlp"))(x)  # [B, T, F]
        up = dense("up_proj", "btd,df->btf", (d, f), ("embed", "mlp"))(x)  # [B, T, F]
        hidden = nn.with_logical_constraint(jax.nn.silu(gate) * up, ("batch", "length", "act_mlp"))
        return dense("down_proj", "btf,fd->btd", (f, d), ("mlp", "embed"))(hidden)  # [B, T, D]


class Block(nn.Module):
    cfg: ModelConfig
    dtype: Dtype = jnp.float32
    param_dtype: Dtype = jnp.float32
    options: ModelOptions = ModelOptions()
    lora: lora_lib.LoraConfig | None = None
    sparse: bool = False  # the MLP is the routed experts (moe.py)

    @nn.compact
    def __call__(self, x, positions, segment_ids, replay=None):
        cfg, dt, pdt = self.cfg, self.dtype, self.param_dtype
        h = RMSNorm("embed", cfg.rms_norm_eps, dt, pdt, name="input_norm")(x)
        attn = Attention(cfg, dt, pdt, self.options, self.lora, name="attn")
        x = x + attn(h, positions, segment_ids)
        x = nn.with_logical_constraint(x, ("batch", "length", "act_embed"))
        h = RMSNorm("embed", cfg.rms_norm_eps, dt, pdt, name="post_attn_norm")(x)
        if self.sparse:
            opts = self.options
            x = x + moe.SparseMoE(cfg, dt, pdt, opts.moe_matmul, opts.moe_block, name="mlp")(
                h, replay
            )
        else:
            x = x + MLP(cfg, dt, pdt, self.lora, name="mlp")(h)
        return nn.with_logical_constraint(x, ("batch", "length", "act_embed"))  # [B, T, D]


class Transformer(nn.Module):
    """tokens, positions, segment_ids [B, T] int32 -> logits [B, T, V] float32, or with
    `head=False` the final-normed hidden states [B, T, D] (for `logprobs.py`)."""

    cfg: ModelConfig
    dtype: Dtype = jnp.float32  # compute dtype
    param_dtype: Dtype = jnp.float32
    options: ModelOptions = ModelOptions()
    lora: lora_lib.LoraConfig | None = None  # adapters on its target projections (lora.py)

    @nn.compact
    def __call__(self, tokens, positions, segment_ids, head: bool = True, routing=None):
        cfg, dt, pdt = self.cfg, self.dtype, self.param_dtype
        check_routing(cfg, tokens.shape, routing)
        embed = Embed(cfg.vocab_size, cfg.hidden_size, dt, pdt, name="embed")
        x = nn.with_logical_constraint(embed(tokens), ("batch", "length", "act_embed"))
        block = self.options.block_class()
        sparse = cfg.moe_layers
        for i in range(cfg.num_layers):
            is_moe = i in sparse
            layer = block(cfg, dt, pdt, self.options, self.lora, is_moe, name=f"layers_{i}")
            replay = None if routing is None or not is_moe else routing[:, :, sparse.index(i)]
            x = layer(x, positions, segment_ids, replay)
        x = RMSNorm("embed", cfg.rms_norm_eps, dt, pdt, name="final_norm")(x)
        if not head:
            return x  # [B, T, D]
        if cfg.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            d, v = cfg.hidden_size, cfg.vocab_size
            logits = Linear(
                "btd,dv->btv",
                (d, v),
                ("embed", "vocab"),
                False,
                dt,
                pdt,
                jnp.float32,
                name="lm_head",
            )(x)  # [B, T, V]
        return nn.with_logical_constraint(
            logits.astype(jnp.float32), ("batch", "length", "act_vocab")
        )


def check_routing(cfg: ModelConfig, token_shape, routing) -> None:
    """Recorded routing must be [B, T, L, k] expert ids for this model's MoE layers."""
    if routing is None:
        return
    want = (*token_shape, len(cfg.moe_layers), cfg.num_experts_per_tok)
    if not cfg.moe_layers:
        raise ValueError(f"routing replay needs a MoE model; {cfg.family} has no MoE layers")
    if tuple(routing.shape) != want:
        raise ValueError(
            f"routing has shape {tuple(routing.shape)}, expected [B, T, L, k] = {want}"
        )
    if not jnp.issubdtype(routing.dtype, jnp.integer):
        raise ValueError(f"routing must be integer expert ids, got {routing.dtype}")


@dataclasses.dataclass(frozen=True)
class Routing:
    """What the MoE layers of one forward saw: router logits [L, B, T, E] (fp32) and the
    learner's own top-k experts [B, T, L, k] (whatever was replayed)."""

    router_logits: jax.Array
    experts: jax.Array


jax.tree_util.register_dataclass(Routing, data_fields=["router_logits", "experts"], meta_fields=[])


def _routing(cfg: ModelConfig, state) -> Routing:
    layers = [state["moe"][f"layers_{i}"]["mlp"] for i in cfg.moe_layers]
    return Routing(
        router_logits=jnp.stack([x["router_logits"][0] for x in layers]),
        experts=jnp.stack([x["own_experts"][0] for x in layers], axis=2),
    )


def token_stats_and_routing(
    net: Transformer, params, tokens, positions, segment_ids, targets, temperature=1.0,
    truncation: Truncation = truncation_lib.NONE, rngs=None, variance: bool = False,
    routing=None,
):  # fmt: skip
    """`token_stats`, with `routing` [B, T, L, k] replayed (None: the model's own), and
    the forward's `Routing` (None for a dense model)."""
    variables = {"params": params}
    chunk = net.options.logprob_chunk
    sparse = bool(net.cfg.moe_layers)
    mutable = ["moe"] if sparse else False

    def apply(head):
        out = net.apply(
            variables, tokens, positions, segment_ids, head=head, rngs=rngs, routing=routing,
            mutable=mutable,
        )  # fmt: skip
        return out if sparse else (out, None)

    if not chunk:
        logits, state = apply(True)
        stats = logprobs.token_stats(logits, targets, temperature, truncation, variance)
    else:
        hidden, state = apply(False)
        weight, eqn = logprobs.head_weight(params, net.cfg.tie_word_embeddings)
        stats = logprobs.chunked_token_stats(
            hidden, weight, eqn, targets, chunk, temperature, dtype=net.dtype,
            truncation=truncation, variance=variance,
        )  # fmt: skip
    return stats, (_routing(net.cfg, state) if sparse else None)


def token_stats(
    net: Transformer, params, tokens, positions, segment_ids, targets, temperature=1.0,
    truncation: Truncation = truncation_lib.NONE, rngs=None, variance: bool = False,
    routing=None,
):  # fmt: skip
    """(log p(target), entropy, argmax == target) [B, T] each, under softmax(logits /
    temperature) after the sampler's `truncation` (learner_jax/model/truncation.py), from the full
    logits or chunk by chunk as `net.options.logprob_chunk` says; with `variance` a fourth,
    Var_p[log p] (logprobs.token_stats). `rngs` ({'dropout': key}) turns on LoRA dropout
    (lora.py); None scores deterministically. `routing`: replayed experts (MoE)."""
    return token_stats_and_routing(
        net, params, tokens, positions, segment_ids, targets, temperature, truncation, rngs,
        variance, routing,
    )[0]  # fmt: skip


def forward_logprobs(
    params,
    cfg: ModelConfig,
    tokens,
    positions,
    segment_ids,
    targets,
    dtype=jnp.float32,
    options: ModelOptions = ModelOptions(),
    temperature: float = 1.0,
    truncation: Truncation = truncation_lib.NONE,
    lora: lora_lib.LoraConfig | None = None,
):
    """log p(targets[b, t] | tokens[b, :t+1]) [B, T] at `temperature` and `truncation`;
    `params` boxed or not (with `lora`: base + adapters, `lora.combine`)."""
    net = Transformer(cfg, dtype=dtype, options=options, lora=lora)
    stats = token_stats(
        net, params, tokens, positions, segment_ids, targets, temperature, truncation
    )
    return stats[0]


def positions_from_segments(segment_ids):
    """Index of each token within its segment [B, T] (0 on padding), for left padding or packing."""
    t = segment_ids.shape[1]
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids.shape)
    first = jnp.ones_like(segment_ids[:, :1], dtype=bool)
    starts = jnp.concatenate([first, segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    start_idx = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)  # index where the run began
    return jnp.where(segment_ids == 0, 0, idx - start_idx)


def _init_boxed(cfg: ModelConfig, rng, param_dtype, lora=None):
    dummy = jnp.ones((1, 1), jnp.int32)
    model = Transformer(cfg, param_dtype=param_dtype, lora=lora)
    return model.init(rng, dummy, jnp.zeros_like(dummy), dummy)["params"]


def init_params(cfg: ModelConfig, rng, param_dtype=jnp.float32):
    """Randomly initialized parameters, unboxed (plain arrays)."""
    # jit: op-by-op init of an unrolled model dispatches thousands of tiny ops.
    return jax.jit(lambda r: nn.unbox(_init_boxed(cfg, r, param_dtype)))(rng)


def abstract_params(cfg: ModelConfig, param_dtype=jnp.float32, lora=None):
    """ShapeDtypeStructs of the parameters, still boxed with their logical axis names."""
    return jax.eval_shape(lambda: _init_boxed(cfg, jax.random.key(0), param_dtype, lora))
