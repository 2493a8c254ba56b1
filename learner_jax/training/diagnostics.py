"""Training-health metrics for RL runs (issue 27: what a collapsing run looks like).

Three places feed them, each cheap enough to log every step:
- `grad_norms_by_layer(grads)` in the train step: `grad_norm/<top-level param>` (embed,
  layers_i, final_norm, lm_head), the gradient before clipping and Adam.
- `group_stats(rewards, adv)` when a batch is built: `adv/zero_groups_frac` (groups whose
  advantages are all 0: their rewards are equal within float rounding, the estimators'
  own definition in advantages.py, and nothing is learned from them),
  `adv/group_std_mean` (mean per-group reward std, the denominator GRPO divides by) and
  `adv/abs_max` (the largest |advantage|: a group of 15 equal rewards and one outlier gives
  the outlier ~3.9).
- `policy_stats(logp, legal)` at evaluation on a task with exact evaluation (Kuhn): over
  the next-token distributions at every decision point, `eval/legal_mass` (probability of
  tokens that parse to an action), `eval/next_token_entropy` and `eval/logit_std` (the
  spread of the logits over the vocabulary, the std of log-softmax, which a constant shift
  does not change: a "logit norm" independent of the softmax's free offset).
"""

from __future__ import annotations

import logging

import jax
import numpy as np
import optax


def grad_norms_by_layer(grads) -> dict[str, jax.Array]:
    """{'grad_norm/<name>': global norm of that top-level subtree} of a params tree."""
    if not isinstance(grads, dict):
        return {}
    return {f"grad_norm/{name}": optax.tree.norm(sub) for name, sub in grads.items()}


def group_stats(rewards: np.ndarray, adv: np.ndarray) -> dict[str, float]:
    """Advantage health of one batch: rewards [G, n], advantages [G * n] (or [G, n])."""
    r = np.asarray(rewards, np.float64)
    std = r.std(axis=1)
    a = np.asarray(adv).reshape(r.shape)
    return {
        "adv/zero_groups_frac": float((a == 0).all(axis=1).mean()),
        "adv/group_std_mean": float(std.mean()),
        "adv/abs_max": float(np.abs(np.asarray(adv, np.float64)).max(initial=0.0)),
    }


def policy_stats(logp: np.ndarray, legal_ids: list[int]) -> dict[str, float]:
    """Next-token health over decision points: logp [points, V] (log-softmax)."""
    logp = np.asarray(logp, np.float64)
    p = np.exp(logp)
    return {
        "eval/legal_mass": float(p[:, legal_ids].sum(axis=1).mean()),
        "eval/next_token_entropy": float(-(p * logp).sum(axis=1).mean()),
        "eval/logit_std": float(logp.std(axis=1).mean()),
    }


# Measured on Kuhn poker (docs/results.md, "Kuhn poker"): with a fresh Adam state and no
# warmup, 1e-3 flattened the policy onto the whole vocabulary within 4 steps (legal-action
# mass 0.97 -> 0.04, never recovered); 5e-4 survived that seed; 3e-4 was steady.
COLD_ADAM_LR = 5e-4
COLD_ADAM_WARMUP = 10


def cold_adam_warning(learning_rate: float, warmup_steps: int) -> str | None:
    """A warning for an RL phase that starts Adam cold at a high rate, else None.

    The RL phase starts a fresh optimizer state (learner.start_rl). Adam's first update is
    lr * g / |g| per parameter (bias-corrected moments of one gradient): every parameter
    moves by the full rate whatever the size of its gradient, the embedding rows of tokens
    never sampled included (tied embeddings: their logits), which flattens the
    next-token distribution. Once no legal action is sampled every group's rewards are
    equal, every advantage 0, and nothing brings the policy back. A warmup lets Adam's
    second moment see several gradients before the rate is high."""
    if learning_rate >= COLD_ADAM_LR and warmup_steps < COLD_ADAM_WARMUP:
        return (
            f"optimizer.learning_rate={learning_rate:g} with optimizer.warmup_steps="
            f"{warmup_steps}: the RL phase starts Adam cold, and its first updates move "
            f"every parameter by the full rate (sign steps); on Kuhn poker this collapsed "
            f"the policy onto illegal tokens within 4 steps. Set optimizer.warmup_steps >= "
            f"{COLD_ADAM_WARMUP} (learner_jax/training/diagnostics.py, BUILD_NOTES.md issue 27)"
        )
    return None


def warn_cold_adam(learning_rate: float, warmup_steps: int) -> str | None:
    """Log `cold_adam_warning` as a warning (the console shows it) when it applies."""
    text = cold_adam_warning(learning_rate, warmup_steps)
    if text:
        logging.getLogger("learner_jax.train").warning(text)
    return text
