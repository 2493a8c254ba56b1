"""The exact check's rule: which sampled tokens count as the seeded sampler's choice, what a
group with one that does not is worth, and when its worker is quarantined.

Every consumed token is recomputed by the learner under the version that sampled it
(learner_jax/rl/exact_check.py) and its `gap` (bridge/contracts/gumbel.py) measured: how
far the token's score z_x + g_x falls below the best score. An honest worker's token is
the argmax of ITS logits, so its gap under the learner's logits comes only from numerics
(a bf16 engine against the fp32 learner): it is 0 unless the two best scores are within
about twice the logit error of each other. A token is a mismatch when its gap exceeds
`MARGIN`.

Consequences:
- a group with any mismatched token does not train (all its rows: its other rows'
  advantages were computed with the chosen row's reward);
- mismatches add up per identity (audit.py: `exact_bad/<identity>`), and
  `QUARANTINE_TOKENS` of them quarantine it.

What the margin leaves a cheater: at each position the tokens whose score is within
MARGIN of the best. For a Gumbel-max over a smooth distribution, the second-best score is
within MARGIN of the best with probability about MARGIN x (the density of the gap at 0,
at most 1 for Gumbel spacings), so a worker that wants another token than the sampler's
gets it past the check on at most ~MARGIN of the positions it tries, and each attempt
that misses is a counted mismatch.

Numbers (bench/verify_cost.py, `honest_mismatch_rate`; docs/design/exact-verification.md):
the honest rate r at MARGIN and the derivation of QUARANTINE_TOKENS from it are there.
"""

from __future__ import annotations

import numpy as np

MARGIN = 0.1  # logits' units (z = logits / T); a bf16 engine's honest gaps stay below it
QUARANTINE_TOKENS = 8  # mismatches of one identity before quarantine


def mismatches(gaps, mask, margin: float = MARGIN):
    """Per-row count of checked positions (mask > 0) whose gap exceeds `margin` (a NaN gap,
    e.g. from non-finite logits, counts as a mismatch) [B]."""
    gaps, on = np.asarray(gaps, np.float64), np.asarray(mask) > 0
    bad = on & ~(gaps <= margin)
    return bad.sum(axis=-1)
