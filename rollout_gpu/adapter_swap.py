"""A worker following a LoRA run: the base loaded once, each version an adapter swap.

A LoRA training binary (learner_jax/rl/adapter_versions.py) announces its `adapters/`
sub-store; each version there is a PEFT adapter whose manifest names the base (full
version `extra.base.version` of the parent store, `kind = "lora_base"`) and carries the
canary of the merged policy and `resident` (S + 1). The worker (rollout_gpu/worker.py):

1. `base_for(store, version, files_dir, cache_dir)`: if the announced version is an
   adapter, read the base version (every chunk verified, its digest checked against the
   adapter's reference) and write it with the store's model files as an HF directory,
   once per base (`<cache_dir>/lora-base-<sha12>`, renamed into place).
2. `start(make_engine, base, cache_dir)`: a LoRA-enabled engine on that directory
   (max rank and resident adapters from the manifest), checked against the base's canary
   before it serves anything.
3. `load_adapter_version` (called by weight_swap.load_version for an adapter manifest):
   fetch + verify + add the adapter (rollout_gpu/adapters.py AdapterServer) beside the
   `resident` ones, make it the engine's active adapter, run its canary (same probes and
   thresholds as a full version), then trim back to `resident`; a failure puts the previous
   adapter back and unloads the new one. Every token the worker then generates runs under
   that adapter (VllmEngine checks each output's), and its lease carries the version.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile

from safetensors.numpy import save_file

from bridge.adapters import store as adapter_store
from bridge.store.weight_store import WeightStore
from rollout_gpu import canary as canary_lib
from rollout_gpu.adapters import AdapterServer


@dataclasses.dataclass(frozen=True)
class LoraBase:
    model_dir: str  # HF dir: the store's model files + the base weights
    max_rank: int
    resident: int  # adapter versions kept loaded (S + 1, at least 2)
    canary: dict | None
    dtype: str


def is_adapter(manifest) -> bool:
    return (manifest.extra or {}).get("kind") == adapter_store.KIND


def base_for(store: WeightStore, version: int, files_dir: str, cache_dir: str) -> LoraBase | None:
    """The base model directory of adapter version `version`; None for a full version."""
    manifest = store.manifest(version)
    if not is_adapter(manifest):
        return None
    ref = manifest.extra.get("base") or {}
    if "version" not in ref:
        raise ValueError(f"adapter version {version} names no base version in its store")
    parent = adapter_store.base_store(store.spec)
    base = parent.manifest(int(ref["version"]))
    if base.extra.get("kind") != adapter_store.BASE_KIND or base.extra.get(
        "weights_sha256"
    ) != ref.get("weights_sha256"):
        raise ValueError(f"{parent.spec} version {ref['version']} is not the adapter's base")
    out = os.path.join(cache_dir, f"lora-base-{ref['weights_sha256'][:12]}")
    if not os.path.isdir(out):
        tensors = parent.read_all(int(ref["version"]))  # every chunk checked
        os.makedirs(cache_dir, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".lora-base-", dir=cache_dir)
        try:
            for name in os.listdir(files_dir):
                shutil.copy(os.path.join(files_dir, name), tmp)
            save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
            os.chmod(tmp, 0o755)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    cfg = manifest.extra["adapter_config"]
    return LoraBase(
        out, int(cfg["r"]), max(2, int(manifest.extra.get("resident", 2))),
        base.extra.get("canary"), base.dtype,
    )  # fmt: skip


def start(make_engine, base: LoraBase, cache_dir: str):
    """`make_engine(model_dir, lora={max_loras, max_lora_rank})`, checked on the base."""
    # One more than `resident`: a new version loads beside them until its canary passes.
    engine = make_engine(base.model_dir, lora={"max_loras": base.resident + 1,
                                               "max_lora_rank": base.max_rank})  # fmt: skip
    cache = os.path.join(cache_dir, "adapters", str(os.getpid()))
    engine.adapters = AdapterServer(engine, None, cache, base.resident, spare=1)
    if base.canary is not None:
        result = _canary(engine, base.canary, base.dtype)
        if not result.ok:
            raise RuntimeError(f"the engine does not score the LoRA base as the learner: {result}")
    return engine


def _canary(engine, payload, published_dtype: str):
    """Same comparison as a full version's (weight_swap.load_version)."""
    both_fp32 = published_dtype == "float32" and engine.dtype == "float32"
    return canary_lib.check_canary(engine, payload, "float32" if both_fp32 else "bfloat16")


def load_adapter_version(engine, store, version: int, manifest, current):
    """Serve adapter `version` from now on (see the module docstring); raises with the
    previous adapter still active, like a refused full version."""
    from rollout_gpu.weight_swap import CanaryMismatch, WeightSwapError

    server: AdapterServer | None = getattr(engine, "adapters", None)
    if server is None:
        raise WeightSwapError(
            f"version {version} is a LoRA adapter and this engine serves none (start the "
            "worker without --model_dir: it builds a LoRA engine from the store's base)"
        )
    request = server.request(version, store)  # verified, base architecture checked
    previous, engine.lora_request = engine.lora_request, request
    result, extra = None, manifest.extra
    if "canary" in extra:
        try:
            result = _canary(engine, extra["canary"], manifest.dtype)
        except Exception as e:
            engine.lora_request = previous
            raise WeightSwapError(f"version {version}: canary could not run: {e}") from e
        if not result.ok:
            engine.lora_request = previous
            current.bad_versions.add(version)
            server.drop(version)
            raise CanaryMismatch(version, result)
    server.trim(version)  # the newest `resident`, the one now served included
    current.version, current.tensors = version, None
    return result
