"""The sampler's truncation (min-p, top-k, top-p) applied to tempered logits, as vLLM does it.

Workers sample from, and report log-probs of (`logprobs_mode="processed_logprobs"`), the
distribution vLLM 0.32's v1 sampler builds from the logits (`Sampler.sample`):

1. divide by the temperature;
2. min-p (`MinPLogitsProcessor`): drop tokens whose probability is below
   `min_p x max probability`;
3. top-k (`apply_top_k_top_p_pytorch` / `apply_top_k_only`): drop logits below the k-th
   largest (ties with it are kept);
4. top-p: sort ascending, drop the prefix whose cumulative probability is <= 1 - p (the
   most likely token always stays);
5. log-softmax over what is left.

For the importance ratio to be right the learner scores tokens under that same processed
distribution: `apply` returns the masked logits (dropped = -inf). The kept set is a
function of the logits but piecewise constant, so it is computed under `stop_gradient`;
the gradient flows through the kept logits only. The sampled token was in the worker's
kept set; at a later policy version (or by float rounding at the boundary) it can fall
out of the learner's, and a -inf log-prob would turn the ratio and its gradient into NaN,
so the target token is always kept (its log-prob is then finite, and small where the new
policy would no longer sample it).

Exact ties at the top-p boundary: vLLM keeps by sorted position, here by value (all tokens
tied with the smallest kept logit stay); float logits of a real model tie there with
probability ~0. `tests/learner_jax/model/truncation_test.py` checks against a numpy transcription
of vLLM's code and `tests/rollout_gpu/truncation_parity_test.py` against real vLLM.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Truncation:
    """`rollout.top_p`, `rollout.top_k`, `rollout.min_p`: 1.0 / -1 (or 0) / 0.0 are off."""

    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0

    def __post_init__(self):
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

    @property
    def active(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0


def kept(tempered, truncation: Truncation, targets=None):
    """bool [..., V]: the tokens the sampler may draw from tempered logits [..., V]
    (and each position's target token, see the module docstring)."""
    x = jax.lax.stop_gradient(tempered)
    keep = jnp.ones(x.shape, bool)
    if truncation.min_p > 0.0:
        probs = jax.nn.softmax(x, axis=-1)
        keep &= probs >= truncation.min_p * probs.max(-1, keepdims=True)
    if 0 < truncation.top_k < x.shape[-1]:
        kth = jax.lax.top_k(jnp.where(keep, x, -jnp.inf), truncation.top_k)[0][..., -1:]
        keep &= x >= kth
    if truncation.top_p < 1.0:
        masked = jnp.where(keep, x, -jnp.inf)
        ascending = jnp.sort(masked, axis=-1)
        cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
        dropped = cumulative <= 1.0 - truncation.top_p
        dropped = dropped.at[..., -1].set(False)  # the most likely token always stays
        # the prefix is dropped: the first kept sorted value is the threshold
        first_kept = jnp.argmin(dropped, axis=-1)[..., None]
        threshold = jnp.take_along_axis(ascending, first_kept, axis=-1)
        keep &= x >= threshold
    if targets is not None:
        keep |= jax.nn.one_hot(targets, x.shape[-1], dtype=bool)
    return keep


def apply(tempered, truncation: Truncation, targets=None):
    """Tempered logits [..., V] with the tokens the sampler drops set to -inf."""
    if not truncation.active:
        return tempered
    return jnp.where(kept(tempered, truncation, targets), tempered, -jnp.inf)


NONE = Truncation()  # sampling from the whole tempered softmax


# -- the run config's `rollout` section (learner_jax/run_config.py validates with it) --
def check_rollout(r) -> None:
    """Refuse `rollout` sampling settings (the run config's section) whose behaviour
    log-probs the learner cannot reproduce.

    Workers report vLLM's processed log-probs: log-softmax of the distribution they sampled
    from (logits / T, then min-p, top-k, top-p), and the RL step scores its tokens under the
    same processing (train_step.py, truncation.py), so those are on-policy. Refused: greedy
    decoding (T = 0: no distribution to correct against), settings out of range, and a
    top-k that cuts the distribution to a single token (then every processed log-prob is 0
    and nothing is learned from the ratio)."""
    t = float(r.temperature)
    top_p, top_k, min_p = (
        float(r.get("top_p", 1.0)),
        int(r.get("top_k", -1)),
        float(r.get("min_p", 0.0)),
    )
    if not (math.isfinite(t) and 0.0 < t <= 100.0):
        raise ValueError(
            f"rollout.temperature={t} is not supported: RL needs sampling from a distribution "
            "(0 < T <= 100); greedy decoding (T=0) has no log-probs to correct against"
        )
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise ValueError(f"rollout.top_p={top_p} is not supported: top-p must be in (0, 1]")
    if top_k < -1 or top_k == 1:
        raise ValueError(
            f"rollout.top_k={top_k} is not supported: -1 or 0 = off, or >= 2 (top_k=1 is "
            "greedy decoding, which has no distribution to correct against)"
        )
    if not (math.isfinite(min_p) and 0.0 <= min_p < 1.0):
        raise ValueError(
            f"rollout.min_p={min_p} is not supported: min-p must be in [0, 1) (1 keeps only "
            "the most likely token: greedy decoding)"
        )


def from_rollout(r) -> Truncation:
    """The sampler's min-p / top-k / top-p from the run config's `rollout` section."""
    return Truncation(
        top_p=float(r.get("top_p", 1.0)),
        top_k=int(r.get("top_k", -1)),
        min_p=float(r.get("min_p", 0.0)),
    )
