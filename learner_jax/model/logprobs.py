"""Per-token log-probs, entropy and argmax hits from final hidden states, chunk by chunk.

At the real vocabulary (Qwen3: V = 151,936) the [T, V] fp32 logits are 0.6 MB per token
per copy, and the loss keeps several copies alive (log-softmax, its exp for the entropy,
their cotangents): at T = 8k that is tens of GB, far more than attention. Here the
unembedding, the tempered log-softmax and the per-token reductions run over `chunk`
tokens at a time inside a `lax.scan` whose body is `jax.checkpoint`ed, so the forward
keeps only the [B, T] results and the backward recomputes one chunk's logits at a time:
memory O(B x chunk x V) instead of O(B x T x V). The gradient of the unembedding is
accumulated across chunks by the scan's transpose ([D, V], the size of the parameter).

The numbers are those of the full path (`model.Transformer` logits -> `jax.nn.log_softmax`):
the same einsum per row, the same fp32 log-softmax; only the order in which rows are
visited differs. `tests/learner_jax/model/logprobs_test.py` checks values and gradients against
the full path in float64, and against transformers.

Einsum letters: B batch, C chunk, D model, V vocab.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from bridge.contracts import gumbel
from learner_jax.model import truncation as truncation_lib
from learner_jax.model.truncation import Truncation


def token_stats(
    logits,
    targets,
    temperature: float = 1.0,
    truncation: Truncation = truncation_lib.NONE,
    variance: bool = False,
):
    """(log p(target), entropy, argmax == target) [B, T] each from logits [B, T, V]; with
    `variance`, a fourth and a fifth: Var_p[log p] and log sum_i p_i^2 per position (the
    sampling check's V and its evidence test's normalizer, bridge/contracts/sampling_check.py).

    Log-probs and entropy are of softmax(logits / temperature) after the sampler's
    `truncation` (min-p, top-k, top-p; truncation.py), the distribution a sampler with those
    settings draws from; `argmax` depends on neither."""
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))  # fp32, or fp64 in tests
    if temperature != 1.0:
        logits = logits / temperature
    processed = truncation_lib.apply(logits, truncation, targets)  # dropped tokens: -inf
    logp_all = jax.nn.log_softmax(processed, axis=-1)  # [B, T, V]
    logp = jnp.take_along_axis(logp_all, targets[..., None], axis=-1)[..., 0]  # [B, T]
    if variance:  # before dropped tokens read 0: they must count p = 0 here
        collision = jax.nn.logsumexp(2.0 * logp_all, axis=-1)  # log sum p^2
    if truncation.active:  # 0 x -inf would be NaN (and its gradient too): dropped terms are 0
        logp_all = jnp.where(jnp.isneginf(processed), 0.0, logp_all)
    entropy = -(jnp.exp(logp_all) * logp_all).sum(-1)  # [B, T]
    correct = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
    if not variance:
        return logp, entropy, correct
    second = (jnp.exp(logp_all) * logp_all * logp_all).sum(-1)  # E_p[(log p)^2]
    return logp, entropy, correct, jnp.maximum(second - entropy * entropy, 0.0), collision


def head_weight(params, tied: bool):
    """The unembedding as (matrix, einsum) from a (boxed or plain) parameter tree:
    the tied embedding [V, D] or the `lm_head` kernel [D, V]."""
    if tied:
        return nn.unbox(params["embed"]["embedding"]), "bcd,vd->bcv"
    return nn.unbox(params["lm_head"]["kernel"]), "bcd,dv->bcv"


def chunked_token_stats(
    hidden,
    weight,
    eqn: str,
    targets,
    chunk: int,
    temperature: float = 1.0,
    dtype=jnp.float32,
    truncation: Truncation = truncation_lib.NONE,
    variance: bool = False,
):
    """`token_stats` of logits = einsum(eqn, hidden, weight), `chunk` tokens at a time.

    hidden [B, T, D] (the final-normed hidden states), weight as `head_weight` returns it,
    targets [B, T] int. The head is computed as the model's own head does it: inputs cast to
    the compute `dtype`, accumulated in fp32 (so bf16 logits stay exact)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    b, t, d = hidden.shape
    chunk = min(chunk, t)  # a chunk longer than the sequence would only add padding
    n = -(-t // chunk)
    pad = n * chunk - t
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    xs = hidden.reshape(b, n, chunk, d).swapaxes(0, 1)  # [n, B, C, D]
    ts = targets.reshape(b, n, chunk).swapaxes(0, 1)  # [n, B, C]
    w = weight.astype(dtype)
    accum = jnp.promote_types(dtype, jnp.float32)

    @jax.checkpoint  # the backward recomputes this chunk's logits instead of storing them
    def one_chunk(x, tgt):
        logits = jnp.einsum(eqn, x.astype(dtype), w, preferred_element_type=accum)
        logits = nn.with_logical_constraint(logits, ("batch", "length", "act_vocab"))
        return token_stats(logits, tgt, temperature, truncation, variance)

    _, out = jax.lax.scan(lambda carry, xt: (carry, one_chunk(*xt)), None, (xs, ts))
    # [n, B, C] each -> [B, T]
    return tuple(o.swapaxes(0, 1).reshape(b, n * chunk)[:, :t] for o in out)


def chunked_sampling_gap(
    hidden,
    weight,
    eqn: str,
    targets,
    key_lo,
    key_hi,
    chunk: int,
    temperature: float,
    truncation: Truncation = truncation_lib.NONE,
    greedy: bool = False,
):
    """How far each target falls short of the seeded sampler's choice, and the scale of
    the logits it was chosen from: (gap, max_v |z_v| over the kept tokens), [B, T] each
    (bridge/contracts/gumbel.py `gap`): max_v(z_v + g_v) - (z_x + g_x), z the processed
    logits (logits / T, then the sampler's truncation WITHOUT keeping the target: a token
    the sampler had dropped scores +inf), g the Gumbel noise of key (key_lo, key_hi) [B]
    at the target's absolute position (its index in the row: targets[b, t] sits at
    t + 1). `greedy`: the plain argmax of the logits (no temperature, no noise).

    hidden [B, T, D] final-normed states, weight as `head_weight` gives it; fp32 logits,
    `chunk` positions at a time (only [B, chunk, V] is ever live)."""
    b, t, d = hidden.shape
    chunk = max(1, min(chunk or t, t))
    n = -(-t // chunk)
    pad = n * chunk - t
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    positions = jnp.broadcast_to(jnp.arange(1, n * chunk + 1, dtype=jnp.uint32), (b, n * chunk))
    xs = hidden.reshape(b, n, chunk, d).swapaxes(0, 1)  # [n, B, C, D]
    ts = targets.reshape(b, n, chunk).swapaxes(0, 1)  # [n, B, C]
    ps = positions.reshape(b, n, chunk).swapaxes(0, 1)  # [n, B, C]
    w = weight.astype(jnp.float32)
    vocab = w.shape[0] if eqn.endswith("vd->bcv") else w.shape[1]
    terms = gumbel.token_terms(vocab, xp=jnp)
    lo, hi = key_lo.astype(jnp.uint32)[:, None], key_hi.astype(jnp.uint32)[:, None]

    def one_chunk(x, tgt, pos):
        logits = jnp.einsum(eqn, x.astype(jnp.float32), w, preferred_element_type=jnp.float32)
        if greedy:
            return gumbel.gap(logits, None, tgt, xp=jnp), jnp.abs(logits).max(-1)
        z = logits / temperature
        if truncation.active:
            z = jnp.where(truncation_lib.kept(z, truncation), z, -jnp.inf)
        scale = jnp.where(jnp.isfinite(z), jnp.abs(z), 0.0).max(-1)
        base = gumbel.position_base(lo, hi, pos, xp=jnp)  # [B, C]
        noise = gumbel.gumbel_from_bits(gumbel.noise_bits(base, terms, xp=jnp), jnp, jnp.float32)
        return gumbel.gap(z, noise, tgt, xp=jnp), scale

    _, out = jax.lax.scan(lambda c, xtp: (c, one_chunk(*xtp)), None, (xs, ts, ps))
    return tuple(o.swapaxes(0, 1).reshape(b, n * chunk)[:, :t] for o in out)
