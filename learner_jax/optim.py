"""The learner's optimizer: global-norm clipping, then AdamW on a warmup + cosine schedule.

    lr(k) = peak * k / warmup                                        k <  warmup
    lr(k) = peak * (f + (1 - f) * (1 + cos(pi * (k - warmup) / (total - warmup))) / 2)
                                                                     warmup <= k <= total
with f = end_lr_fraction (lr stays at peak * f after total_steps). Step 0 of a warmup has
lr 0, optax's convention. Weight decay is decoupled (AdamW) and applies to every parameter:
norms and biases included, as in optax's default; pass a mask through `weight_decay_mask`
to exempt some.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import optax

from bridge.config.keys import SCHEMA


@dataclasses.dataclass(frozen=True)
@SCHEMA.declared_fields
class OptimizerConfig:
    """`config.optimizer`'s keys (bridge/config/keys.py) and the phase's step count."""

    total_steps: int = 1000

    def __post_init__(self):
        if self.learning_rate < 0:
            raise ValueError(f"learning_rate must be >= 0, got {self.learning_rate}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"total_steps ({self.total_steps}) must exceed warmup_steps ({self.warmup_steps})"
            )
        if not 0.0 <= self.end_lr_fraction <= 1.0:
            raise ValueError(f"end_lr_fraction must be in [0, 1], got {self.end_lr_fraction}")
        if not (0.0 <= self.b1 < 1.0 and 0.0 <= self.b2 < 1.0):
            raise ValueError(f"b1, b2 must be in [0, 1), got {self.b1}, {self.b2}")
        if self.eps <= 0 or self.weight_decay < 0:
            raise ValueError("eps must be > 0 and weight_decay >= 0")


def make_schedule(cfg: OptimizerConfig) -> optax.Schedule:
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps,
        decay_steps=cfg.total_steps,  # optax counts the warmup inside decay_steps
        end_value=cfg.learning_rate * cfg.end_lr_fraction,
    )


def make_optimizer(
    cfg: OptimizerConfig, weight_decay_mask: Any | None = None
) -> optax.GradientTransformation:
    """clip_by_global_norm(max_grad_norm) -> adamw(schedule); clipping sees the raw grads."""
    adamw = optax.adamw(
        learning_rate=make_schedule(cfg),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        mask=weight_decay_mask,
    )
    if cfg.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
    return adamw
