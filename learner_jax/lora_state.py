"""The learner's side of a LoRA run: the checkpoint's reference to the frozen base, and
the merged policy (base + adapters) for publishing full weights and for evaluation.

A LoRA checkpoint holds only the adapters and their optimizer state (checkpoint.py); the
cursor's `lora_base` names the base it trains on: the HF directory, a SHA-256 over its
safetensors files, and the LoRA config. A resume loads the base from that directory and
refuses one whose weights changed since (the adapters would no longer mean the same).
"""

from __future__ import annotations

import os
from typing import Any

import jax

from bridge.adapters.merge import CURSOR_KEY, weights_digest
from learner_jax import lora

__all__ = ["CURSOR_KEY", "weights_digest", "base_reference", "check_resume", "merge_fn"]


def base_reference(hf_dir: str, cfg: lora.LoraConfig) -> dict[str, Any]:
    return {
        "hf_dir": os.path.abspath(hf_dir),
        "weights_sha256": weights_digest(hf_dir),
        "lora": cfg.to_dict(),
    }


def check_resume(cursor: dict, hf_dir: str, cfg: lora.LoraConfig | None) -> None:
    """Refuse a resume whose LoRA setting or base weights differ from the checkpoint's."""
    ref = cursor.get(CURSOR_KEY)
    if cfg is None:
        if ref is not None:
            raise ValueError("the checkpoint is a LoRA run's (adapters only); set learner.lora")
        return
    if ref is None:
        raise ValueError("the checkpoint is a full-weight run's; learner.lora.rank must be 0")
    if ref["lora"] != cfg.to_dict():
        raise ValueError(
            f"learner.lora {cfg.to_dict()} differs from the checkpoint's {ref['lora']}"
        )
    digest = weights_digest(hf_dir)
    if digest != ref["weights_sha256"]:
        raise ValueError(
            f"base weights in {hf_dir} (sha256 {digest[:12]}) are not the ones the adapters "
            f"were trained on ({ref['hf_dir']}, sha256 {ref['weights_sha256'][:12]})"
        )


def merge_fn(cfg: lora.LoraConfig, base_shardings):
    """jit((base, adapters) -> merged params), laid out like the base."""
    return jax.jit(lambda b, a: lora.merged_params(b, a, cfg), out_shardings=base_shardings)
