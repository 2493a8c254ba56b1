"""JAX edge of adapter versions: the learner's trained adapters (a sharded Flax tree, the
LoRA `TrainState.params`) as PEFT tensors, published through bridge/weights/adapter_store.py,
and back (`policy_from_peft`: the audit re-scores rows under a stored adapter version).

Adapters are small (rank x (in + out) per projection: ~1% of the model at Qwen3-0.6B
shapes and rank 16), so each leaf is gathered to the host whole; the full-weight path
(publish.py) streams shards because the model is not small.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np
from flax import traverse_util

from bridge.adapters import peft_layout
from bridge.model.config import ModelConfig
from bridge.store.manifest import Manifest
from bridge.store.weight_store import WeightStore
from bridge.weights import adapter_store
from learner_jax import lora


def peft_tensors(adapters: Mapping) -> dict[str, np.ndarray]:
    """PEFT tensor name -> float32 [out, in] array of every adapter leaf."""
    flat = traverse_util.flatten_dict(dict(jax.device_get(adapters)))
    return peft_layout.to_peft({p: np.asarray(v, np.float32) for p, v in flat.items()})


def adapter_config(cfg: lora.LoraConfig, base_model: str | None = None) -> dict:
    return peft_layout.adapter_config(
        cfg.rank, cfg.alpha, list(cfg.module_names), cfg.dropout, base_model
    )


def publish_adapter_version(
    store: WeightStore,
    version: int,
    step: int,
    model_cfg: ModelConfig,
    cfg: lora.LoraConfig,
    adapters: Mapping,
    base: Mapping | None = None,
    dtype: str = "float32",
    extra: Mapping | None = None,
) -> Manifest:
    """One adapter version (PEFT layout) of the learner's current adapters."""
    return adapter_store.publish_adapter(
        store,
        version,
        step,
        peft_tensors(adapters),
        adapter_config(cfg, (base or {}).get("hf_dir")),
        model_cfg.to_hf_dict(),
        base,
        dtype,
        extra,
    )


def policy_from_peft(learner, version: int, tensors: Mapping[str, np.ndarray]):
    """The merged policy of stored adapter tensors, laid out like `learner`'s params."""
    stored = peft_layout.from_peft(dict(tensors), learner.model_cfg)
    like = traverse_util.flatten_dict(dict(learner.state.params))
    if set(stored) != set(like):
        raise ValueError(f"adapter version {version} has other tensors than the learner's")
    put = lambda p: jax.device_put(np.asarray(stored[p], like[p].dtype), like[p].sharding)
    return learner.policy_of(traverse_util.unflatten_dict({p: put(p) for p in like}))
