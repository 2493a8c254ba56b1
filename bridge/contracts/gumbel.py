"""Seeded, verifiable sampling: the noise both stacks compute bit for bit.

A worker picks each sampled token as a deterministic function of the lease's seed and the
policy's processed logits (Gumbel-max):

    token = argmax_v ( z_v + g(key, position, v) ),   z = logits / T after min-p, top-k, top-p
                                                          (dropped tokens -inf)

with `key = seed + sample_index` (the seed the controller drew for the group; vLLM gives
the i-th sample of a request the seed `seed + i`) and `position` the token's index in the
whole sequence (prompt + completion, so a multi-turn episode's later turns continue the
count). argmax(z + Gumbel) is an exact sample of softmax(z), so an honest worker samples
the policy; the learner, which recomputes z anyway, recomputes g and checks that every
sampled token is the argmax (`gap`), up to a margin for engine numerics
(bridge/contracts/exact_check.py). A worker cannot choose its tokens: any other token is
caught, not estimated.

The noise is counter-based: 32-bit integer hashing (`mix32`, the "lowbias32" finalizer)
of (key, position, token id), so numpy, jax.numpy and torch (rollout_gpu/
verifiable_sampler.py, in int64 with a 32-bit mask) produce the same bits; only the float
transform u -> -log(-log u) may differ by an ulp between libms, which the margin covers.
u = (bits >> 9 + 1/2) / 2^23 is exact in float32 and never 0 or 1.

`xp` is the array module: numpy here, jax.numpy inside the learner's jitted check.
"""

from __future__ import annotations

import secrets

import numpy as np

_GOLDEN = 0x9E3779B9
_TOKEN_MUL = 0x85EBCA6B
_TOKEN_ADD = 0x68E31DA4
_MUL1 = 0x7FEB352D
_MUL2 = 0x846CA68B
MANTISSA_BITS = 23  # u has 23 random bits: exact in float32, in (0, 1) open
SEED_LIMIT = 1 << 62  # seeds below this; + a sample index stays an int64


def draw_seed() -> int:
    """A fresh, unpredictable sampling seed for one group (the controller's)."""
    return secrets.randbelow(SEED_LIMIT)


def key_words(seed: int, sample_index: int) -> tuple[int, int]:
    """(lo, hi) 32-bit words of the noise key of sample `sample_index` of a group."""
    key = int(seed) + int(sample_index)
    if not 0 <= key < 1 << 63:
        raise ValueError(f"sampling key {key} out of range (seed {seed}, sample {sample_index})")
    return key & 0xFFFFFFFF, key >> 32


def mix32(x, xp=np):
    """The lowbias32 integer finalizer on uint32 arrays (wrapping multiplies)."""
    with np.errstate(over="ignore"):  # the wrap is the point
        x = x ^ (x >> 16)
        x = x * xp.uint32(_MUL1)
        x = x ^ (x >> 15)
        x = x * xp.uint32(_MUL2)
        return x ^ (x >> 16)


def position_base(lo, hi, position, xp=np):
    """uint32 [...]: the hash of (key, position) that every token's bits start from."""
    u32 = xp.uint32
    lo, hi, position = (xp.asarray(a).astype(u32) for a in (lo, hi, position))
    return mix32(mix32(mix32(lo ^ u32(_GOLDEN), xp) ^ hi, xp) ^ position, xp)


def token_terms(vocab: int, xp=np):
    """uint32 [V]: each token id's own hash, shared by every position."""
    ids = xp.arange(vocab, dtype=xp.uint32)
    with np.errstate(over="ignore"):
        return mix32(ids * xp.uint32(_TOKEN_MUL) + xp.uint32(_TOKEN_ADD), xp)


def noise_bits(base, terms, xp=np):
    """uint32 [..., V]: the random bits of every token at each position of `base` [...]."""
    return mix32(base[..., None] ^ terms, xp)


def gumbel_from_bits(bits, xp=np, dtype=np.float64):
    """Standard Gumbel noise from `noise_bits`: -log(-log u), u = (bits >> 9 + 1/2) / 2^23."""
    shift = 32 - MANTISSA_BITS
    u = ((bits >> shift).astype(dtype) + 0.5) * (2.0**-MANTISSA_BITS)
    return -xp.log(-xp.log(u))


def gumbel(lo, hi, position, vocab: int, xp=np, dtype=np.float64):
    """Gumbel noise [..., V] of keys (lo, hi) at `position` (broadcast together)."""
    base = position_base(lo, hi, position, xp)
    return gumbel_from_bits(noise_bits(base, token_terms(vocab, xp), xp), xp, dtype)


def gap(processed, noise, tokens, xp=np):
    """How far each sampled token falls short of the Gumbel argmax [...]: max_v(z_v + g_v)
    - (z_x + g_x) for processed logits z [..., V] (dropped tokens -inf), noise g [..., V]
    and tokens x [...]. 0 for the argmax; +inf for a token the sampler had dropped.
    `noise` None: greedy decoding (the plain argmax of z)."""
    score = processed if noise is None else processed + noise
    best = score.max(axis=-1)
    picked = xp.take_along_axis(score, tokens[..., None].astype(np.int32), axis=-1)[..., 0]
    return best - picked
