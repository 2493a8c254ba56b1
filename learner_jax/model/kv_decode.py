"""Decoding with a KV cache: prefill the prompt once, then one token per step.

    fn = decode_fn(cfg, prompt_len=P, new_tokens=A, dtype, temperature=0.0, eos_id=e)
    out = fn(params, prompts [B, P], prompt_segments [B, P], key)   # [B, A] int32

The learner's own evaluator (`evaluate.py`) uses this; `evaluate.full_forward_fn` is the
cache-free reference it replaced (every step re-ran the whole [B, P + A] forward, a
576-token answer took minutes on the tiny model; this takes seconds, `bench/eval.py`).

Prompts are left-padded to P (segment 0 = padding), so every row's last prompt token sits
at P - 1 and the i-th generated token of every row is written at slot P + i of a cache of
fixed length P + A: one compile per (B, P, A). The cache holds each layer's rotated keys
and values, [B, P + A, K, H] in the compute dtype; a query attends to the filled slots
that are real tokens (prompt slots with a nonzero segment, every generated slot) at
indices <= its own, which is exactly the mask the cache-free forward builds from its
segment ids, and positions continue from each row's prompt length as there.

The module below reuses model.py's parameter modules under the same names (embed,
layers_i/{input_norm, attn/{q,k,v,o}_proj, q_norm, k_norm, post_attn_norm, mlp},
final_norm, lm_head), so it applies to the learner's parameter tree as is (merged LoRA
params included: `Learner.policy_params`). Attention math is the reference
(`attention.xla_attention`): fp32 scores, the same finite fill, softmax, cast back.

Sampling: temperature 0 is greedy (argmax); otherwise `jax.random.categorical` of the
tempered logits after the sampler's truncation (`truncation.py`: min-p, top-k, top-p as
vLLM does), one key per step folded from `key`. Decoding stops early once every row has
emitted `eos_id` (-1: never); slots after a row's EOS hold `pad_id`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from bridge.model.config import ModelConfig
from learner_jax.model import model, moe
from learner_jax.model import truncation as truncation_lib
from learner_jax.model.attention import _FILL


def _cached_attention(q, k, v, visible):
    """q [B, T, N, H] over cache k, v [B, S, K, H]; visible [B, T, S] bool."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    q = q.reshape(b, t, kh, n // kh, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * h**-0.5
    scores = jnp.where(visible[:, None, None], scores, _FILL)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    return jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(b, t, n, h)


class CachedAttention(nn.Module):
    cfg: ModelConfig
    dtype: model.Dtype = jnp.float32

    @nn.compact
    def __call__(self, x, positions, cache_k, cache_v, start, visible):
        cfg, dt = self.cfg, self.dtype
        d, n, k, h = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

        def proj(name, heads, axis):
            return model.Linear(
                "btd,dnh->btnh", (d, heads, h), ("embed", axis, "kv"), cfg.attention_bias, dt,
                name=name,
            )(x)  # fmt: skip

        q, key, v = (
            proj("q_proj", n, "heads"),
            proj("k_proj", k, "kv_heads"),
            proj("v_proj", k, "kv_heads"),
        )
        if cfg.qk_norm:
            q = model.RMSNorm("kv", cfg.rms_norm_eps, dt, name="q_norm")(q)
            key = model.RMSNorm("kv", cfg.rms_norm_eps, dt, name="k_norm")(key)
        q = model.apply_rope(q, positions, cfg.rope_theta)
        key = model.apply_rope(key, positions, cfg.rope_theta)
        cache_k = jax.lax.dynamic_update_slice_in_dim(cache_k, key.astype(cache_k.dtype), start, 1)
        cache_v = jax.lax.dynamic_update_slice_in_dim(cache_v, v.astype(cache_v.dtype), start, 1)
        out = _cached_attention(q, cache_k, cache_v, visible)
        out = model.Linear(
            "btnh,nhd->btd", (n, h, d), ("heads", "kv", "embed"), False, dt, name="o_proj"
        )(out)
        return out, cache_k, cache_v


class CachedBlock(nn.Module):
    cfg: ModelConfig
    dtype: model.Dtype = jnp.float32
    sparse: bool = False  # a MoE layer: the routed experts (moe.py) in place of the MLP

    @nn.compact
    def __call__(self, x, positions, cache_k, cache_v, start, visible):
        cfg, dt = self.cfg, self.dtype
        h = model.RMSNorm("embed", cfg.rms_norm_eps, dt, name="input_norm")(x)
        a, cache_k, cache_v = CachedAttention(cfg, dt, name="attn")(
            h, positions, cache_k, cache_v, start, visible
        )
        x = x + a
        h = model.RMSNorm("embed", cfg.rms_norm_eps, dt, name="post_attn_norm")(x)
        if self.sparse:
            return x + moe.SparseMoE(cfg, dt, name="mlp")(h), cache_k, cache_v
        return x + model.MLP(cfg, dt, name="mlp")(h), cache_k, cache_v


class CachedTransformer(nn.Module):
    """(tokens [B, T], positions [B, T], caches k, v [L, B, S, K, H], start, visible
    [B, T, S]) -> (last-token logits [B, V] fp32, caches with slots start..start+T-1 set)."""

    cfg: ModelConfig
    dtype: model.Dtype = jnp.float32

    @nn.compact
    def __call__(self, tokens, positions, cache_k, cache_v, start, visible):
        cfg, dt = self.cfg, self.dtype
        embed = model.Embed(cfg.vocab_size, cfg.hidden_size, dt, name="embed")
        x = embed(tokens)
        ks, vs = [], []
        for i in range(cfg.num_layers):
            x, ck, cv = CachedBlock(cfg, dt, cfg.is_moe_layer(i), name=f"layers_{i}")(
                x, positions, cache_k[i], cache_v[i], start, visible
            )
            ks.append(ck)
            vs.append(cv)
        x = model.RMSNorm("embed", cfg.rms_norm_eps, dt, name="final_norm")(x[:, -1:])
        if cfg.tie_word_embeddings:
            logits = embed.attend(x)
        else:
            d, v = cfg.hidden_size, cfg.vocab_size
            logits = model.Linear(
                "btd,dv->btv", (d, v), ("embed", "vocab"), False, dt, accum_dtype=jnp.float32,
                name="lm_head",
            )(x)  # fmt: skip
        return logits[:, 0].astype(jnp.float32), jnp.stack(ks), jnp.stack(vs)


def pick(logits, key, temperature: float, truncation=truncation_lib.NONE):
    """Next tokens [B] from last-token logits [B, V]: argmax at temperature 0, else a draw
    from the tempered, truncated softmax."""
    if temperature == 0.0:
        return jnp.argmax(logits, -1).astype(jnp.int32)
    tempered = truncation_lib.apply(logits / temperature, truncation)
    return jax.random.categorical(key, tempered, axis=-1).astype(jnp.int32)


def decode_fn(
    cfg: ModelConfig,
    prompt_len: int,
    new_tokens: int,
    dtype=jnp.float32,
    temperature: float = 0.0,
    truncation: truncation_lib.Truncation = truncation_lib.NONE,
    eos_id: int = -1,
    pad_id: int = 0,
):
    """The jitted decoder (see the module docstring): (params, prompts [B, P] int32,
    segments [B, P] int32, key) -> generated tokens [B, A] int32."""
    if temperature < 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    net = CachedTransformer(cfg, dtype=dtype)
    p, a = prompt_len, new_tokens
    s = p + a

    def decode(params, prompts, segments, key):
        b = prompts.shape[0]
        shape = (cfg.num_layers, b, s, cfg.num_kv_heads, cfg.head_dim)
        cache_k = jnp.zeros(shape, dtype)
        cache_v = jnp.zeros(shape, dtype)
        real = jnp.concatenate([segments != 0, jnp.ones((b, a), bool)], axis=1)  # [B, S]
        slots = jnp.arange(s)
        # Prefill: query t (slot t) sees real slots <= t.
        causal = slots[None, :p, None] >= slots[None, None, :]  # [1, P, S]
        visible = causal & real[:, None, :] & (segments != 0)[:, :, None]
        positions = model.positions_from_segments(segments)  # [B, P]
        logits, cache_k, cache_v = net.apply(
            {"params": params}, prompts, positions, cache_k, cache_v, 0, visible
        )
        prompt_lens = (segments != 0).sum(-1).astype(jnp.int32)  # [B]
        out = jnp.full((b, a), pad_id, jnp.int32)
        done = jnp.zeros((b,), bool)

        def cond(carry):
            i, _, _, _, _, done = carry
            return (i < a) & ~jnp.all(done)

        def body(carry):
            i, logits, cache_k, cache_v, out, done = carry
            tok = pick(logits, jax.random.fold_in(key, i), temperature, truncation)
            tok = jnp.where(done, pad_id, tok)
            out = jax.lax.dynamic_update_index_in_dim(out, tok, i, 1)
            done = done | (tok == eos_id)
            # Step i's token goes to slot p + i and sees real slots <= p + i.
            visible = (real & (slots[None, :] <= p + i))[:, None, :]  # [B, 1, S]
            pos = (prompt_lens + i)[:, None]
            logits, cache_k, cache_v = net.apply(
                {"params": params}, tok[:, None], pos, cache_k, cache_v, p + i, visible
            )
            return i + 1, logits, cache_k, cache_v, out, done

        init = (jnp.int32(0), logits, cache_k, cache_v, out, done)
        return jax.lax.while_loop(cond, body, init)[4]

    return jax.jit(decode)
