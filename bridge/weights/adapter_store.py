"""Adapter versions in the weight store: a LoRA run publishes each version as its PEFT
adapter (bridge/adapters/peft_layout.py) instead of full weights, through the same
versioned, digested store (bridge/store/weight_store.py) and so the same relay chain.

Where: a sub-store `adapters/` under the run's store spec, so workers that follow full
versions never mistake an adapter for a model (and the two kinds never share a version
number space). Each adapter version is an ordinary version of that store: one array per
PEFT tensor name, written first, then the manifest with per-chunk BLAKE3 digests, whose
`extra` says what it is:

    extra = {"kind": "lora_adapter",
             "adapter_config": {...peft adapter_config.json...},
             "base": {"hf_dir", "weights_sha256", "lora"}}   (learner_jax/lora_state.py)

and whose `model_config` is the base model's HF config (a worker checks it serves that
base). `fetch_adapter_dir` reads a version, verifying every array against the manifest,
and writes the PEFT directory vLLM's `LoRARequest` and `peft` load, atomically.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from bridge.adapters import peft_layout
from bridge.store.manifest import Manifest
from bridge.store.weight_store import WeightStore, parse_spec

KIND = "lora_adapter"
BASE_KIND = "lora_base"
SUBDIR = "adapters/"


def adapter_store(spec: str | Mapping[str, Any]) -> WeightStore:
    """The adapter sub-store of a run's store spec (any kvstore driver)."""
    out = parse_spec(spec)
    out["path"] = out.get("path", "") + SUBDIR
    return WeightStore(out)


def publish_adapter(
    store: WeightStore,
    version: int,
    step: int,
    tensors: Mapping[str, np.ndarray],
    adapter_config: Mapping[str, Any],
    base_hf_config: Mapping[str, Any],
    base: Mapping[str, Any] | None = None,
    dtype: str = "float32",
    extra: Mapping[str, Any] | None = None,
) -> Manifest:
    """Publish one adapter version (PEFT tensor names -> [out, in] arrays); `extra` adds
    manifest fields (the training binary's: `canary`, `resident`)."""
    for name in tensors:
        peft_layout.flax_path(name)  # raises on a name that is not a PEFT LoRA tensor
    extra = {
        **dict(extra or {}),
        "kind": KIND,
        "adapter_config": dict(adapter_config),
        "base": dict(base or {}),
    }
    return store.publish(version, step, sorted(tensors.items()), base_hf_config, dtype, extra)


def base_store(adapter_spec: str | Mapping[str, Any]) -> WeightStore:
    """The run's main store, the parent of an adapter sub-store: where the training binary
    publishes the frozen base once, as an ordinary full version (`extra.kind = BASE_KIND`),
    for workers that start without a local copy of it."""
    out = parse_spec(adapter_spec)
    path = out.get("path", "")
    if not path.endswith(SUBDIR):
        raise ValueError(f"{out} is not an adapter sub-store (its path does not end in {SUBDIR})")
    out["path"] = path[: -len(SUBDIR)]
    return WeightStore(out)


def adapter_manifest(store: WeightStore, version: int) -> Manifest:
    manifest = store.manifest(version)
    if manifest.extra.get("kind") != KIND:
        raise ValueError(f"version {version} of {store} is not a LoRA adapter version")
    return manifest


def fetch_adapter_dir(store: WeightStore, version: int, out_dir: str) -> str:
    """Write version `version` as a PEFT adapter directory at `out_dir` (verified, atomic:
    a failed read leaves nothing there); returns `out_dir`."""
    manifest = adapter_manifest(store, version)
    tensors = store.read_all(version)  # every array checked against the manifest's digests
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".adapter-", dir=parent)
    try:
        peft_layout.write_adapter_dir(tmp, tensors, manifest.extra["adapter_config"])
        os.chmod(tmp, 0o755)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
