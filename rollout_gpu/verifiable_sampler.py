"""Seeded, verifiable sampling inside vLLM: Gumbel-max with the contract's noise, in torch.

    engine.llm.collective_rpc(install)    # VllmEngine.start does this

Each sampled token is `argmax_v(z_v + g(key, position, v))` (bridge/contracts/gumbel.py), z
the logits vLLM's sampler has processed (temperature, min-p, top-k, top-p; dropped tokens
-inf), key the request's seed (`SamplingParams.extra_args[SEED_KEY]`, one single-sample
request per sample: rollout_gpu/vllm_engine.py says why not vLLM's own `seed`) and position
the index of the token being sampled in the whole sequence. `VerifiableSampler` takes the
place of vLLM 0.32's `TopKTopPSampler` in the model runner's `Sampler`: top-k/top-p and the
reported log-probs are vLLM's own (`apply_top_k_top_p`, log-softmax of the processed logits
in `processed_logprobs` mode), so the behaviour log-probs stay the policy's, not the noised
scores'; only the draw changes. Greedy rows (T = 0) never reach it (`Sampler.sample` picks
their argmax itself), and a request without a seed gets fresh random keys each step.

The noise bits equal the contract's (numpy/jax uint32) bit for bit. Each row's hash of
(key, position) is the contract's numpy `position_base` (a few values per step); the
per-token part, over [rows, V], runs in torch: the uint32 hash in int64 tensors masked to
32 bits after every multiply. A constant >= 2^31 is used as
`c - 2^32` (congruent mod 2^32), so every product of a 32-bit value stays below 2^63 and
nothing relies on signed overflow. Only -log(-log u), in float32 here, may differ from the
learner's by an ulp or so, which its margin covers.

Speed: the per-token work is ~20 elementwise steps over [rows, V]; run eagerly they are
~10x slower than vLLM's fused CPU kernel at V = 151936, so `gumbel_argmax` runs them as
one `torch.compile`d kernel (inductor: C++ on CPU, triton on GPU), compiled when installed
(~15-30 s on CPU; then one sampler call on 64 rows x 151936 takes 68 ms against vLLM's
107 ms here, bench/sampler_cost.py). Below `COMPILE_MIN_VOCAB` tokens the eager steps cost
less than the compile would ever win back (tiny test models: V = 128).
"""

from __future__ import annotations

import logging
import os
import weakref

import numpy as np
import torch
from torch import nn

from bridge.contracts import gumbel

SEED_KEY = "echo2_seed"  # the SamplingParams.extra_args key rollout_gpu/vllm_engine.py sets

log = logging.getLogger(__name__)

MASK = 0xFFFFFFFF


def _mod32_factor(c: int) -> int:
    """`c` or `c - 2^32`, whichever is below 2^31 in magnitude: x * it = x * c (mod 2^32),
    and for x < 2^32 the int64 product cannot overflow."""
    return c - (1 << 32) if c >= 1 << 31 else c


_MUL1 = _mod32_factor(gumbel._MUL1)
_MUL2 = _mod32_factor(gumbel._MUL2)
_TOKEN_MUL = _mod32_factor(gumbel._TOKEN_MUL)
_SHIFT = 32 - gumbel.MANTISSA_BITS


def mix32(x: torch.Tensor) -> torch.Tensor:
    """gumbel.mix32 on int64 tensors holding uint32 values (in [0, 2^32))."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & MASK
    x = x ^ (x >> 15)
    x = (x * _MUL2) & MASK
    return x ^ (x >> 16)


def token_terms(vocab: int, device=None) -> torch.Tensor:
    """int64 [V]: gumbel.token_terms."""
    ids = torch.arange(vocab, dtype=torch.int64, device=device)
    return mix32(((ids * _TOKEN_MUL) + gumbel._TOKEN_ADD) & MASK)


def noise_bits(base: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    """int64 [..., V]: gumbel.noise_bits."""
    return mix32(base[..., None] ^ terms)


def gumbel_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """float32 Gumbel noise: -log(-log u), u = (bits >> 9 + 1/2) / 2^23 (exact in float32)."""
    u = ((bits >> _SHIFT).to(torch.float32) + 0.5) * (2.0**-gumbel.MANTISSA_BITS)
    return -torch.log(-torch.log(u))


def _gumbel_argmax(z: torch.Tensor, base: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    return (z + gumbel_from_bits(noise_bits(base, terms))).argmax(dim=-1)


_compiled = None  # the fused `_gumbel_argmax`, once `compile_kernel` succeeded
# One sampler call on 64 rows, eager vs compiled, on one CPU core: V = 1024 0.54 vs 0.24 ms,
# V = 8192 7.0 vs 1.7 ms, V = 151936 570 vs 33 ms; the compile costs ~3 s of CPU at each
# worker start (warm inductor cache), which below 4,096 tokens takes >10,000 calls to repay.
COMPILE_MIN_VOCAB = 4096


def compile_kernel(vocab: int, device) -> bool:
    """Compile (and run once) the fused kernel for any number of rows; False if the
    platform cannot compile (then `gumbel_argmax` runs eagerly, same bits, slower)."""
    global _compiled
    if _compiled is not None:
        return True
    fn = torch.compile(_gumbel_argmax, dynamic=True)
    try:
        for rows in (2, 1):  # no recompile at 1 row: the batch dim is unbacked
            z = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
            base = torch.zeros(rows, dtype=torch.int64, device=device)
            _mark_rows_dynamic(z, base)
            fn(z, base, token_terms(vocab, device))
    except Exception:  # noqa: BLE001 - any compiler failure leaves the eager path
        log.warning("verifiable sampler: torch.compile failed, sampling eagerly", exc_info=True)
        return False
    _compiled = fn
    return True


def _mark_rows_dynamic(z, base) -> None:
    # Without this a 1-row batch specializes and recompiles (dynamo's 0/1 rule).
    torch._dynamo.decorators.mark_unbacked(z, 0)
    torch._dynamo.decorators.mark_unbacked(base, 0)


def gumbel_argmax(z: torch.Tensor, base: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    """int64 [B]: argmax_v(z[b, v] + g(base[b], v)) for float32 z [B, V], bases [B]."""
    if _compiled is None:
        return _gumbel_argmax(z, base, terms)
    _mark_rows_dynamic(z, base)
    return _compiled(z, base, terms)


def key_bases(seeds: list[int | None], positions: np.ndarray, device=None) -> torch.Tensor:
    """int64 [B]: the position base of each row's key (its seed; None: a fresh random key)
    at its position. Per row, not per token: the contract's own numpy code computes it."""
    words = np.frombuffer(os.urandom(8 * len(seeds)), dtype=np.uint32).reshape(-1, 2).copy()
    for i, seed in enumerate(seeds):
        if seed is not None:  # gumbel.key_words(seed, 0): vLLM's seed includes the index
            words[i] = seed & MASK, (seed >> 32) & MASK
    base = gumbel.position_base(words[:, 0], words[:, 1], np.asarray(positions, np.int64))
    return torch.from_numpy(base.astype(np.int64)).to(device)


class VerifiableSampler(nn.Module):
    """vLLM's `TopKTopPSampler` interface (forward(logits, generators, k, p) -> (tokens,
    processed logits/log-probs or None)), drawing with the contract's noise. `generators`
    (vLLM's per-request torch generators) are not used: the seed is the key."""

    def __init__(self, original: nn.Module, runner, vocab: int):
        super().__init__()
        self.original = original  # put back by `uninstall`
        self.logprobs_mode = original.logprobs_mode
        self._runner = weakref.ref(runner)  # the runner owns us through its sampler
        self.terms = token_terms(vocab, runner.device)

    def row_seeds_positions(self, rows: int) -> tuple[list[int | None], np.ndarray]:
        """Each logits row's request seed and the position of the token it samples: rows
        are the input batch's requests in order; num_tokens_no_spec counts prompt and
        output tokens so far, i.e. it is the index of the token being sampled."""
        runner = self._runner()
        batch = runner.input_batch
        req_ids = batch.req_ids[:rows]
        seeds: list[int | None] = []
        for req_id in req_ids:
            state = runner.requests.get(req_id)
            args = getattr(getattr(state, "sampling_params", None), "extra_args", None) or {}
            seeds.append(args.get(SEED_KEY))
        positions = np.zeros(rows, np.int64)
        positions[: len(req_ids)] = batch.num_tokens_no_spec[: len(req_ids)]
        seeds += [None] * (rows - len(req_ids))  # dummy rows (profiling runs)
        return seeds, positions

    def forward(self, logits, generators, k, p):
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        logits = apply_top_k_top_p(logits, k, p)
        processed = None
        if self.logprobs_mode == "processed_logits":
            processed = logits
        elif self.logprobs_mode == "processed_logprobs":
            processed = logits.log_softmax(dim=-1, dtype=torch.float32)
        if self.terms.shape[0] != logits.shape[-1]:  # token_terms(V)[:W] == token_terms(W)
            self.terms = token_terms(logits.shape[-1], logits.device)
        seeds, positions = self.row_seeds_positions(logits.shape[0])
        base = key_bases(seeds, positions, logits.device)
        return gumbel_argmax(logits.to(torch.float32), base, self.terms), processed


def install(worker) -> bool:
    """Runs on each worker (`collective_rpc`): put a `VerifiableSampler` in the model
    runner's sampler and compile its kernel. Idempotent; returns True."""
    runner = worker.model_runner
    sampler = getattr(runner, "sampler", None)
    current = getattr(sampler, "topk_topp_sampler", None)
    if isinstance(current, VerifiableSampler):
        return True
    if current is None or not hasattr(runner, "input_batch"):
        raise RuntimeError(
            f"{type(runner).__name__} has no sampler.topk_topp_sampler / input_batch "
            "(vLLM 0.32's v1 model runner); the verifiable sampler cannot be installed"
        )
    vocab = runner.model_config.get_vocab_size()
    if vocab >= COMPILE_MIN_VOCAB:
        compile_kernel(vocab, runner.device)
    sampler.topk_topp_sampler = VerifiableSampler(current, runner, vocab)
    return True


def uninstall(worker) -> bool:
    """Runs on each worker: put vLLM's own sampler back (benchmarks compare the two)."""
    sampler = worker.model_runner.sampler
    if isinstance(sampler.topk_topp_sampler, VerifiableSampler):
        sampler.topk_topp_sampler = sampler.topk_topp_sampler.original
    return True


def installed(worker) -> bool:
    return isinstance(worker.model_runner.sampler.topk_topp_sampler, VerifiableSampler)
