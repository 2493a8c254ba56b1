"""Per-version canary: does the engine score fixed probe sequences like the learner does?

After a hot swap the worker scores a few fixed token sequences with vLLM and compares the
per-token log-probs with the ones the learner computed for the same version (stored in
`Manifest.extra["canary"]`, built by `canary_payload`). Checksums prove the bytes
arrived; the canary proves they mean the same model on both sides, catching silent
conversion bugs (a transposed square matrix, a wrong layout table, a dtype mix-up).

Criteria (per the weight-bridge contract):
- fp32 (version and engine both fp32): max |lp_engine - lp_learner| <= 1e-3.
- bf16 (either side bf16): the RMS of d = lp_learner - lp_engine over the probe tokens
  <= 5% of the spread of the learner's probe log-probs (their standard deviation, at
  least 0.5 nats). A bf16 engine's error grows with the logits' size, and so does the
  spread: the probe tokens are not samples of either policy, and a trained model puts
  them at log-probs of -17 +- 5, where bf16 rounding moves them by tenths of a nat. A
  fixed limit (it was mean k3 <= 1e-3) either refuses every version of a trained model
  on a bf16 engine or passes a corrupt flat one. Measured (vLLM bf16 engine, fp32
  versions): the demo's tiny model after 2,000 SFT steps, RMS 0.082 against a limit of
  0.27 (spread 5.46); the same weights with one q_norm reset, two layers swapped, one
  down_proj's columns reversed: RMS 1.9, 25, 117; a flat random model (spread below
  0.5) with a transposed square v_proj: RMS 0.18 against 0.025, honest 7e-4. The mean
  k3 (the same estimator as `mismatch/kl`) is reported beside it.
  A full-vocabulary KL would need V log-probs per position in the manifest (150k x
  probe tokens for a real model) for no gain in catching corruption.

numpy only: both stacks import this module (the learner builds the payload, the
worker compares); `rollout_gpu/canary.py` scores the probes with the engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from bridge.contracts.k3 import k3

FP32_MAX_ABS_DIFF = 1e-3
BF16_MAX_RMS_REL = 0.05  # x the spread of the learner's probe log-probs ...
BF16_MIN_SPREAD = 0.5  # ... taken as at least this (nats): a flat model's is ~0.1


def probe_token_lists(
    num_tokens: int,
    bos_id: int | None,
    num_seqs: int = 4,
    length: int = 24,
    seed: int = 0,
    first_regular_id: int = 3,
) -> list[list[int]]:
    """Fixed probe sequences: BOS then ids drawn uniformly from [first_regular_id, num_tokens).

    `num_tokens` is the tokenizer's size (vLLM rejects ids outside it, which can be smaller
    than the model's padded vocab). Deterministic in its arguments, so learner and worker
    agree without shipping the sequences -- they are shipped anyway, in the payload.
    """
    if num_tokens <= first_regular_id:
        raise ValueError(f"num_tokens={num_tokens} leaves no regular token ids")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_seqs):
        ids = rng.integers(first_regular_id, num_tokens, size=length).tolist()
        out.append(([bos_id] if bos_id is not None else []) + ids)
    return out


def canary_payload(
    token_lists: Sequence[Sequence[int]], logprobs_list: Sequence[np.ndarray]
) -> dict:
    """The JSON-able dict the learner stores as `Manifest.extra["canary"]`.

    `logprobs_list[i][j]` = log p(token_lists[i][j + 1] | token_lists[i][: j + 1]), so
    each has one entry fewer than its sequence.
    """
    if len(token_lists) != len(logprobs_list) or not token_lists:
        raise ValueError("need one log-prob array per probe sequence, and at least one")
    tokens, logprobs = [], []
    for ids, lps in zip(token_lists, logprobs_list, strict=True):
        lps = np.asarray(lps, dtype=np.float64).reshape(-1)
        if len(ids) < 2 or lps.shape != (len(ids) - 1,):
            raise ValueError(
                f"probe of {len(ids)} tokens needs {len(ids) - 1} log-probs, got {lps.shape}"
            )
        if not np.all(np.isfinite(lps)):
            raise ValueError("canary log-probs must be finite")
        tokens.append([int(t) for t in ids])
        logprobs.append([float(x) for x in lps])
    return {"token_lists": tokens, "logprobs": logprobs}


@dataclasses.dataclass(frozen=True)
class CanaryResult:
    ok: bool
    max_abs_diff: float
    kl: float  # mean per-token k3 estimate, see the module docstring
    detail: str


def compare(
    engine_lps: Sequence[np.ndarray], learner_lps: Sequence[np.ndarray], dtype: str
) -> CanaryResult:
    """Apply the dtype's criterion to two sets of per-token log-probs."""
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"canary dtype must be float32 or bfloat16, got {dtype!r}")
    if len(engine_lps) != len(learner_lps) or not engine_lps:
        raise ValueError(f"{len(engine_lps)} engine vs {len(learner_lps)} learner sequences")
    eng_l = [np.asarray(x, np.float64).reshape(-1) for x in engine_lps]
    ref_l = [np.asarray(x, np.float64).reshape(-1) for x in learner_lps]
    for i, (e, r) in enumerate(zip(eng_l, ref_l, strict=True)):
        if e.shape != r.shape:
            raise ValueError(f"probe {i}: {e.size} engine log-probs vs {r.size} learner log-probs")
    eng, ref = np.concatenate(eng_l), np.concatenate(ref_l)
    if not np.all(np.isfinite(eng)):
        return CanaryResult(False, float("inf"), float("inf"), "engine log-probs not finite")
    d = ref - eng
    max_abs = float(np.max(np.abs(d)))
    kl = float(np.mean(k3(d)))
    if dtype == "float32":
        ok = max_abs <= FP32_MAX_ABS_DIFF
        crit = f"max|diff|={max_abs:.3g} (limit {FP32_MAX_ABS_DIFF:g})"
    else:
        rms = float(np.sqrt(np.mean(d * d)))
        limit = BF16_MAX_RMS_REL * max(float(np.std(ref)), BF16_MIN_SPREAD)
        ok = rms <= limit
        crit = (
            f"RMS diff={rms:.3g} (limit {limit:.3g}), mean k3 KL={kl:.3g}, max|diff|={max_abs:.3g}"
        )
    worst = int(np.argmax(np.abs(d)))
    detail = f"{dtype} canary over {d.size} tokens: {crit}; worst token #{worst}"
    return CanaryResult(ok, max_abs, kl, detail)
