"""Advantage estimators over groups of samples, and the DAPO group filter.

Every estimator maps rewards `[G, n]` (G prompts, n samples of each) to per-sample
advantages `[G, n]`; the learner flattens them to `[B = G * n]` for `losses.py`.

    grpo     A_gi = (r_gi - mean_i r_g) / (std_i r_g + eps)      (Shao et al., 2024)
    dr_grpo  A_gi =  r_gi - mean_i r_g                           (Liu et al., 2025)

`group_filter` is DAPO's dynamic-sampling criterion (Yu et al., 2025): a group whose n
rewards are all equal carries no signal (every advantage is 0), so it is dropped from the
loss normalizers. The learner passes the resulting `seq_mask` into `losses.LossInputs`.

Equal means equal within float rounding, one definition for both estimators and the
filter (`informative`): a group is degenerate when max r - min r <= n * eps * max |r|
(eps of the rewards' dtype), the rounding a mean of n values of magnitude |r| can carry.
Such a group gets exactly 0 advantages. Without it, 32 float32 rewards of 0.96 have a
mean that is off by a few ulps, std ~ 1e-7, and GRPO divides that rounding by
(std + 1e-6) into |A| ~ 0.3 per sample: a gradient from nothing. The other groups are
centred on their first reward before the mean is taken, so their rounding scales with the
group's spread, not with the rewards' magnitude.

Deliberate departures from the papers:
- std is the population std (ddof=0). The GRPO reference code uses the unbiased one
  (ddof=1), which is undefined for n = 1 and scales advantages by sqrt((n-1)/n); with
  ddof=0 a group of one sample gets advantage 0, as it should.
- DAPO oversamples prompts until the batch holds only informative groups; we keep the
  batch shape fixed (jit-friendly) and mask the uninformative groups instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp

from bridge.config.keys import SCHEMA

AdvantageFn = Callable[..., jnp.ndarray]
_ADVANTAGES: dict[str, AdvantageFn] = {}


def register_advantage(name: str) -> Callable[[AdvantageFn], AdvantageFn]:
    """Decorator: `@register_advantage("grpo")` adds an estimator to the registry."""

    def deco(fn: AdvantageFn) -> AdvantageFn:
        if name in _ADVANTAGES:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        _ADVANTAGES[name] = fn
        return fn

    return deco


def get_advantage(name: str) -> AdvantageFn:
    if name not in _ADVANTAGES:
        raise KeyError(f"unknown advantage estimator {name!r}; known: {sorted(_ADVANTAGES)}")
    return _ADVANTAGES[name]


def available_advantages() -> list[str]:
    return sorted(_ADVANTAGES)


def _check_rewards(rewards: jnp.ndarray) -> jnp.ndarray:
    rewards = jnp.asarray(rewards)
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [G, n] (groups x samples), got shape {rewards.shape}")
    if not jnp.issubdtype(rewards.dtype, jnp.floating):
        rewards = rewards.astype(jnp.float32)  # integer/bool rewards from task adapters
    return rewards


def informative(rewards: jnp.ndarray) -> jnp.ndarray:
    """bool [G]: True for groups whose rewards are not all equal within float rounding.

    A mean of n values of magnitude |r| is computed to about n * eps * |r|, so a spread
    no larger than that is indistinguishable from the rounding of the mean itself.
    """
    r = _check_rewards(rewards)  # [G, n]
    n = r.shape[1]
    tol = n * jnp.finfo(r.dtype).eps * jnp.abs(r).max(axis=1)  # [G]
    return (r.max(axis=1) - r.min(axis=1)) > tol


def _centered(r: jnp.ndarray) -> jnp.ndarray:
    """r - mean(r) per group [G, n], 0 in degenerate groups (see the module docstring)."""
    # Shifting by the group's first reward first: the mean of r - r_0 rounds at the scale
    # of the spread, not of |r| (the shifted-data algorithm for variance).
    d = r - r[:, :1]
    c = d - d.mean(axis=1, keepdims=True)
    return jnp.where(informative(r)[:, None], c, 0.0)


@register_advantage("grpo")
def grpo_advantages(rewards: jnp.ndarray, eps: float = 1e-6) -> jnp.ndarray:
    c = _centered(_check_rewards(rewards))  # [G, n]
    std = jnp.sqrt((c * c).mean(axis=1, keepdims=True))  # population std, module docstring
    return c / (std + eps)


@register_advantage("dr_grpo")
def dr_grpo_advantages(rewards: jnp.ndarray, eps: float = 1e-6) -> jnp.ndarray:
    del eps  # no std normalization: that is the point of Dr. GRPO
    return _centered(_check_rewards(rewards))  # [G, n]


def group_filter(rewards: jnp.ndarray, atol: float = 0.0) -> jnp.ndarray:
    """bool [G]: True for groups whose rewards are not all equal (within float rounding,
    `informative`, and within atol): exactly the groups whose advantages can be nonzero."""
    r = _check_rewards(rewards)  # [G, n]
    return informative(r) & ((r.max(axis=1) - r.min(axis=1)) > atol)


@dataclasses.dataclass(frozen=True)
@SCHEMA.declared_fields
class AdvantageConfig:
    """`config.advantages`: name, eps, filter_equal_groups, filter_atol (bridge/config/keys.py)."""

    def __post_init__(self):
        get_advantage(self.name)  # fails early on an unknown name
        if self.eps < 0 or self.filter_atol < 0:
            raise ValueError("eps and filter_atol must be >= 0")


def compute_advantages(
    rewards: jnp.ndarray, cfg: AdvantageConfig
) -> tuple[jnp.ndarray, jnp.ndarray]:
    """rewards [G, n] -> (advantages [G*n], seq_mask [G*n] float32), sample-major per group.

    seq_mask is 1 everywhere unless cfg.filter_equal_groups, where it zeroes the samples of
    groups whose rewards are all equal.
    """
    r = _check_rewards(rewards)
    g, n = r.shape
    adv = get_advantage(cfg.name)(r, eps=cfg.eps)  # [G, n]
    if cfg.filter_equal_groups:
        keep = group_filter(r, cfg.filter_atol)  # [G]
    else:
        keep = jnp.ones((g,), dtype=bool)
    seq_mask = jnp.repeat(keep, n).astype(jnp.float32)  # [G*n]
    return adv.reshape(g * n), seq_mask
