"""The k3 estimate of KL between two scorings of the same tokens: both stacks use this one.

With d = lp_p - lp_q on tokens sampled from q, k3 = exp(d) - 1 - d is an unbiased,
never-negative per-token estimate of KL(q || p) (Schulman's k3). `expm1(d) - d` keeps
tiny on-policy values (d ~ 1e-6) out of the cancellation `exp(d) - 1` suffers in fp32,
and the clamp at 0 removes the last rounding below zero. The learner's `mismatch/kl`,
its KL penalty metric and the weight canary all compute it here, so the canary's
threshold and the metric mean the same number.

`xp` is the array module: numpy by default, `jax.numpy` inside jitted learner code.
"""

from __future__ import annotations

import numpy as np


def k3(d, xp=np):
    """Per-token k3 for log-ratio(s) `d` = log p - log q (elementwise, never negative)."""
    return xp.maximum(xp.expm1(d) - d, 0.0)
