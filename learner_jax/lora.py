"""LoRA adapters on the Flax policy: the config, the adapter math inside `model.Linear`,
and the split of a parameter tree into the frozen base and the adapters that train.

A targeted projection with kernel W [in..., out...] (the `model.Linear` convention) gets
two more parameters beside its kernel, in the same "params" collection:

    lora_a  [in..., R]   logical axes: the kernel's input axes, then 'lora_rank'
    lora_b  [R, out...]  logical axes: 'lora_rank', then the kernel's output axes

    y = x W (+ bias) + (alpha / R) * (dropout(x) lora_a) lora_b

which is peft's `LoraLayer.forward` (base output, then lora_B(lora_A(dropout(x))) *
scaling). The adapters are sharded by the same rule table as the kernels they adapt;
'lora_rank' is not in the default table, so the rank axis is replicated (a config may
add a rule for it). Initialization is peft's default: lora_a uniform with bound
1/sqrt(fan_in) (kaiming_uniform with a=sqrt(5)), lora_b zero, so a fresh adapter leaves
the policy exactly the base model.

The learner trains only the adapters: `TrainState.params` holds them (so the optimizer
state holds only their moments) and `TrainState.frozen` holds the base tree, which the
step closes over without differentiating it (`train_step.make_step_fn`) and checkpoints
leave out (`checkpoint.py`; the checkpoint cursor references the base instead).

Dropout (peft's lora_dropout) applies only when the caller passes a 'dropout' RNG (the
train step's loss pass with `dropout > 0`); scoring, the step's audit and mismatch rows
(a deterministic pass of their own), publishing and the canary run without it.
Einsum letter: z the adapter rank (the other letters are the kernel's, model.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from bridge.config.keys import SCHEMA

# Short name (config) -> the Flax module name of the projection it adapts.
TARGETS = {
    "q": "q_proj",
    "k": "k_proj",
    "v": "v_proj",
    "o": "o_proj",
    "gate": "gate_proj",
    "up": "up_proj",
    "down": "down_proj",
}
ADAPTER_LEAVES = ("lora_a", "lora_b")
RANK_AXIS = "lora_rank"
_RANK_LETTER = "z"
# peft's kaiming_uniform_(a=sqrt(5)): bound = 1/sqrt(fan_in).
_A_INIT = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


@dataclasses.dataclass(frozen=True)
@SCHEMA.declared_fields
class LoraConfig:
    """`learner.lora.*`: rank (0 = LoRA off), alpha, target_modules, dropout
    (bridge/config/keys.py)."""

    def __post_init__(self):
        if self.rank < 0:
            raise ValueError(f"learner.lora.rank must be >= 0 (0 = off), got {self.rank}")
        if not self.alpha > 0:
            raise ValueError(f"learner.lora.alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"learner.lora.dropout must be in [0, 1), got {self.dropout}")
        names = tuple(_short_name(t) for t in self.target_modules)  # raises on unknown ones
        if not names:
            raise ValueError("learner.lora.target_modules is empty")
        object.__setattr__(self, "target_modules", names)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def module_names(self) -> tuple[str, ...]:
        """Flax (and HF) module names of the adapted projections, e.g. 'q_proj'."""
        return tuple(TARGETS[t] for t in self.target_modules)

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "alpha": self.alpha,
            "target_modules": list(self.target_modules),
            "dropout": self.dropout,
        }


def _short_name(name: str) -> str:
    short = name.removesuffix("_proj")
    if short not in TARGETS:
        raise ValueError(f"unknown LoRA target {name!r}; known {sorted(TARGETS)}")
    return short


def from_dict(d: Mapping | None) -> LoraConfig | None:
    """A `LoraConfig` from config data (the `learner.lora` section), None when rank is 0."""
    if not d or not int(d.get("rank", 0)):
        return None
    targets = d.get("target_modules", tuple(TARGETS))
    if isinstance(targets, str):
        targets = tuple(t.strip() for t in targets.split(",") if t.strip())
    return LoraConfig(
        rank=int(d["rank"]),
        alpha=float(d.get("alpha", 16.0)),
        target_modules=tuple(targets),
        dropout=float(d.get("dropout", 0.0)),
    )


def from_config(config) -> LoraConfig | None:
    """The run config's `learner.lora` section (absent or rank 0: None, LoRA off)."""
    section = config.get("learner", {}).get("lora")
    return from_dict(section.to_dict() if hasattr(section, "to_dict") else section)


def _split_eqn(eqn: str) -> tuple[str, str, str, int]:
    """(x letters, kernel letters, y letters, number of kernel input axes)."""
    ins, y = eqn.split("->")
    x, w = ins.split(",")
    if _RANK_LETTER in eqn:
        raise ValueError(f"einsum {eqn!r} already uses the rank letter {_RANK_LETTER!r}")
    n_in = sum(1 for c in w if c in x and c not in y)  # contracted = the kernel's input axes
    return x, w, y, n_in


def adapter_delta(module: nn.Module, x, eqn: str, shape, names, cfg: LoraConfig, dtype, pdt):
    """(alpha/R) * (dropout(x) lora_a) lora_b, with the same output shape as `eqn`."""
    xs, w, ys, n_in = _split_eqn(eqn)
    w_in, w_out = w[:n_in], w[n_in:]
    r = cfg.rank
    a = module.param(
        "lora_a",
        nn.with_logical_partitioning(_A_INIT, (*names[:n_in], RANK_AXIS)),
        (*shape[:n_in], r),
        pdt,
    )
    b = module.param(
        "lora_b",
        nn.with_logical_partitioning(nn.initializers.zeros, (RANK_AXIS, *names[n_in:])),
        (r, *shape[n_in:]),
        pdt,
    )
    if cfg.dropout > 0 and module.has_rng("dropout"):
        keep = 1.0 - cfg.dropout
        mask = jax.random.bernoulli(module.make_rng("dropout"), keep, x.shape)
        x = jnp.where(mask, x / keep, 0).astype(x.dtype)
    xa_letters = "".join(c for c in xs if c not in w_in) + _RANK_LETTER
    xa = jnp.einsum(f"{xs},{w_in}{_RANK_LETTER}->{xa_letters}", x.astype(dtype), a.astype(dtype))
    y = jnp.einsum(f"{xa_letters},{_RANK_LETTER}{w_out}->{ys}", xa, b.astype(dtype))
    return y * jnp.asarray(cfg.scale, dtype)


# -- parameter trees ---------------------------------------------------------------------------


def is_adapter(path: tuple[str, ...]) -> bool:
    return path[-1] in ADAPTER_LEAVES


def split_params(params: Mapping) -> tuple[dict, dict]:
    """(base tree, adapter tree) of a LoRA model's parameters (boxed or not)."""
    flat = traverse_util.flatten_dict(dict(params))
    base = {p: v for p, v in flat.items() if not is_adapter(p)}
    adapters = {p: v for p, v in flat.items() if is_adapter(p)}
    return traverse_util.unflatten_dict(base), traverse_util.unflatten_dict(adapters)


def combine(base: Mapping | None, adapters: Mapping) -> Any:
    """The LoRA model's parameter tree from its two parts; `adapters` alone when no base."""
    if base is None:
        return adapters
    flat = traverse_util.flatten_dict(dict(base))
    flat.update(traverse_util.flatten_dict(dict(adapters)))
    return traverse_util.unflatten_dict(flat)


def merged_params(base: Mapping, adapters: Mapping, cfg: LoraConfig, xp=jnp) -> dict:
    """The base tree with every adapted kernel replaced by W + (alpha/R) lora_a lora_b: a
    plain model of the base's structure (what full-weight workers and `--merge` export get).
    `xp` is jax.numpy (jit it; sharded arrays stay sharded) or numpy."""
    flat = traverse_util.flatten_dict(dict(base))
    ad = traverse_util.flatten_dict(dict(adapters))
    for path in [p for p in ad if p[-1] == "lora_a"]:
        module = path[:-1]
        a, b = ad[path], ad[(*module, "lora_b")]
        kernel = flat[(*module, "kernel")]
        delta = xp.tensordot(a.astype(xp.float32), b.astype(xp.float32), axes=1) * cfg.scale
        flat[(*module, "kernel")] = (kernel.astype(xp.float32) + delta).astype(kernel.dtype)
    return traverse_util.unflatten_dict(flat)


def adapter_count(adapters: Mapping) -> int:
    """Number of trainable scalars (for logs and the bench)."""
    return int(sum(x.size for x in jax.tree.leaves(adapters)))
