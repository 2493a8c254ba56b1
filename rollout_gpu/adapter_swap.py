"""A worker following a LoRA run: the base loaded once, each version an adapter swap.

A LoRA training binary (bridge/weights/adapter.py `AdapterWriter`) announces its
`adapters/` sub-store; each version there is a PEFT adapter whose manifest names the base
(full version `extra.base.version` of the parent store) and carries the canary of the
merged policy and `resident` (S + 1). The adapter strategy (bridge/weights/adapter.py)
calls the worker side here:

1. `start(make_engine, base, cache_dir)`: a LoRA-enabled engine on the base's model
   directory (the strategy's `base_dir`; max rank and resident adapters from the
   manifest), checked against the base's canary before it serves anything.
2. `load_adapter_version`: fetch + verify + add the adapter (rollout_gpu/adapters.py
   AdapterServer) beside the `resident` ones, make it the engine's active adapter, run its
   canary (same probes and thresholds as a full version), then trim back to `resident`; a
   failure puts the previous adapter back and unloads the new one. Every token the worker
   then generates runs under that adapter (VllmEngine checks each output's), and its lease
   carries the version.
"""

from __future__ import annotations

import os

from bridge.weights.adapter import LoraBase
from rollout_gpu.adapters import AdapterServer
from rollout_gpu.served_version import CanaryMismatch, WeightSwapError, version_canary


def start(make_engine, base: LoraBase, cache_dir: str):
    """`make_engine(model_dir, lora={max_loras, max_lora_rank})`, checked on the base."""
    # One more than `resident`: a new version loads beside them until its canary passes.
    engine = make_engine(base.model_dir, lora={"max_loras": base.resident + 1,
                                               "max_lora_rank": base.max_rank})  # fmt: skip
    cache = os.path.join(cache_dir, "adapters", str(os.getpid()))
    engine.adapters = AdapterServer(engine, None, cache, base.resident, spare=1)
    if base.canary is not None:
        result = version_canary(engine, base.canary, base.dtype)
        if not result.ok:
            raise RuntimeError(f"the engine does not score the LoRA base as the learner: {result}")
    return engine


def load_adapter_version(engine, store, version: int, manifest, current):
    """Serve adapter `version` from now on (see the module docstring); raises with the
    previous adapter still active, like a refused full version."""
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
            result = version_canary(engine, extra["canary"], manifest.dtype)
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
