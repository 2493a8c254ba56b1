"""Advantage estimators over groups of samples, and the DAPO group filter.

Every estimator maps rewards `[G, n]` (G prompts, n samples of each) to per-sample
advantages `[G, n]`; the learner flattens them to `[B = G * n]` for `losses.py`.

    grpo     A_gi = (r_gi - mean_i r_g) / (std_i r_g + eps)      (Shao et al., 2024)
    dr_grpo  A_gi =  r_gi - mean_i r_g                           (Liu et al., 2025)

`group_filter` is DAPO's dynamic-sampling criterion (Yu et al., 2025): a group whose n
rewards are all equal carries no signal (every advantage is 0), so it is dropped from the
loss normalizers. The learner passes the resulting `seq_mask` into `losses.LossInputs`.

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


@register_advantage("grpo")
def grpo_advantages(rewards: jnp.ndarray, eps: float = 1e-6) -> jnp.ndarray:
    r = _check_rewards(rewards)  # [G, n]
    mean = r.mean(axis=1, keepdims=True)
    std = r.std(axis=1, keepdims=True)  # population std, see the module docstring
    return (r - mean) / (std + eps)


@register_advantage("dr_grpo")
def dr_grpo_advantages(rewards: jnp.ndarray, eps: float = 1e-6) -> jnp.ndarray:
    del eps  # no std normalization: that is the point of Dr. GRPO
    r = _check_rewards(rewards)  # [G, n]
    return r - r.mean(axis=1, keepdims=True)


def group_filter(rewards: jnp.ndarray, atol: float = 0.0) -> jnp.ndarray:
    """bool [G]: True for groups whose rewards are not all equal (within atol)."""
    r = _check_rewards(rewards)  # [G, n]
    return (r.max(axis=1) - r.min(axis=1)) > atol


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    name: str = "grpo"
    eps: float = 1e-6
    filter_equal_groups: bool = False  # DAPO dynamic-sampling filter
    filter_atol: float = 0.0

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
