"""The exact check's rule: which sampled tokens count as the seeded sampler's choice, what a
group with one that does not is worth, and when an identity is quarantined.

Every consumed token is recomputed by the learner under the version that sampled it
(learner_jax/rl/exact_check.py) and its `gap` (bridge/contracts/gumbel.py) measured: how
far the token's score z_x + g_x falls below the best score. An honest worker's token is
the argmax of ITS logits, so its gap under the learner's logits comes only from numerics:
0 for an fp32 engine (bit-equal noise, logits equal to ~1e-6), and for a bf16 engine 0
unless the two best scores are within about twice its logit error of each other.

- A token whose gap exceeds `margin` (MARGIN_ABS + MARGIN_REL x max |z| at its position
  for a worker that declares a bf16/fp16 engine: its logit errors grow with the logits;
  FP32_MARGIN, 1e-3, for an fp32 engine) is a **mismatch**: its group does not train
  (all its rows: its other rows' advantages were computed with the chosen row's reward).
- A token with FLIP_GAP < gap <= margin is a **flip**: the engine's numerics (or a worker
  using the margin's slack) chose a near-tie runner-up. It trains (an honest bf16 engine
  flips some tokens), and flips are counted.
- Per identity (audit.py: `exact_bad/`, `exact_flips/`, `exact_checked/<identity>`):
  QUARANTINE_TOKENS mismatches that are also QUARANTINE_FRACTION of its checked tokens,
  or FLIP_TOKENS flips that are FLIP_FRACTION of them, quarantine it.

What the margin leaves a cheater: the runner-up at positions where it is within the
margin of the best, a share of positions that grows with the margin; using it raises the
identity's flip rate above an honest engine's (FLIP_FRACTION), and the statistical audits
(sampling_check.py) stay as a second layer. An fp32 engine needs no slack at all.

Numbers: `python -m bench.honest_mismatch` (the honest gap distribution of a real vLLM
engine, bf16 and fp32, flat and peaked weights) and docs/design/exact-verification.md.
"""

from __future__ import annotations

import numpy as np

# A token counts as the sampler's choice when its gap is within
#     margin = MARGIN_ABS + MARGIN_REL x max_v |z_v|
# (z the processed logits at its position): a bf16 engine's logits differ from the fp32
# learner's roughly in proportion to their size.
MARGIN_ABS = 0.02
MARGIN_REL = 0.08
# An fp32 engine computes the learner's numbers to ~1e-6: its tokens get no slack.
FP32_MARGIN = (1e-3, 0.0)
# A gap above this (float noise of two fp32 stacks) but within the margin is a near-tie
# flip: the engine's numerics chose the runner-up, or a worker used the margin's slack.
FLIP_GAP = 1e-3
QUARANTINE_TOKENS = 8  # an identity is quarantined at this many mismatches ...
QUARANTINE_FRACTION = 0.01  # ... once they are also this share of its checked tokens,
FLIP_TOKENS = 32  # ... or at this many flips ...
FLIP_FRACTION = 0.05  # ... that are this share of them


def margins_for(engine_dtype: str, abs_margin: float = MARGIN_ABS,
                rel_margin: float = MARGIN_REL) -> tuple[float, float]:  # fmt: skip
    """(abs, rel) margin of a worker's declared engine dtype: the configured one for a
    half-precision engine, FP32_MARGIN for an fp32 one."""
    return FP32_MARGIN if engine_dtype == "float32" else (abs_margin, rel_margin)


def margin(scale, abs_margin: float = MARGIN_ABS, rel_margin: float = MARGIN_REL):
    """The allowed gap at positions whose max |z| is `scale`."""
    return abs_margin + rel_margin * np.asarray(scale, np.float64)


def quarantines(bad: int, checked: int, tokens: int = QUARANTINE_TOKENS,
                fraction: float = QUARANTINE_FRACTION) -> bool:  # fmt: skip
    """Whether `bad` mismatches among `checked` tokens of one identity quarantine it
    (`tokens` 0: never)."""
    return 0 < tokens <= bad and bad >= fraction * checked


def false_quarantine_bound(rate: float, tokens: int = QUARANTINE_TOKENS,
                           fraction: float = QUARANTINE_FRACTION) -> float:  # fmt: skip
    """The largest probability, over how many tokens an identity gets checked, that honest
    mismatches at `rate` per token reach the quarantine rule (scipy's binomial tail)."""
    from scipy import stats

    # Every n up to well past tokens / fraction, where the count rule hands over to the
    # share rule and the tail peaks, then a geometric grid to a billion tokens.
    dense = int(20 * tokens / fraction) if fraction > 0 else 100 * tokens
    tail = np.geomspace(max(dense, tokens), 1e9, 400).astype(np.int64)
    n = np.unique(np.concatenate([np.arange(tokens, dense + 1), tail]))
    need = np.maximum(tokens, np.ceil(fraction * n)).astype(np.int64)
    return float(stats.binom.sf(need - 1, n, rate).max())


def classify(gaps, scales, mask, abs_margin: float = MARGIN_ABS,
             rel_margin: float = MARGIN_REL):  # fmt: skip
    """Per row: (mismatched, flipped) counts over the checked positions (mask > 0); a NaN
    gap (non-finite logits) is a mismatch."""
    gaps, on = np.asarray(gaps, np.float64), np.asarray(mask) > 0
    bad = on & ~(gaps <= margin(scales, abs_margin, rel_margin))
    flip = on & ~bad & (gaps > FLIP_GAP)
    return bad.sum(axis=-1), flip.sum(axis=-1)
