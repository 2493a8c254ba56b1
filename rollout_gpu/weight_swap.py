"""Transactional hot swap of a published weight version into a running rollout engine.

`load_version` hands the version to its kind's strategy (bridge/weights/kinds.py), which
calls back the engine side here: for full and delta versions, read the version from the
weight store (every checksum verified; a delta version is rebuilt from the version served,
or its anchor, and only the engine modules it changed are reloaded: `reload_names`) ->
validate names, shapes, dtypes and finiteness against the engine's architecture ->
`RolloutEngine.load_weights` in place -> per-version canary (`rollout_gpu/canary.py`); for
an adapter version, rollout_gpu/adapter_swap.py. Any refusal leaves the engine serving the
previous version; the error names the cause.

Why validation is complete and happens before the engine is touched: an engine loads
layer by layer, so a layer that receives only some of its tensors (say q_proj but not
k/v of a fused qkv) is left with uninitialized memory for the rest, and a name the
engine does not know raises after earlier layers were already replaced (vLLM 0.32:
see rollout_gpu/vllm_engine.py). So a partial or misnamed version is never handed to
the engine: we require exactly the engine's HF parameter set.

If the load itself fails anyway (an I/O error in a streamed iterator, a loader
assertion), the engine repairs its own state and we reload the previous version: from
the host copy of its tensors we keep (the version the loader read last), or from the
engine's model directory on disk for the initial weights. Keeping the last version on
host costs one model of RAM, which a worker needs anyway while it reads the next
version; it makes rollback independent of store GC.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging as pylogging
from collections.abc import Mapping

import numpy as np

from bridge.model import layouts
from bridge.model.config import ModelConfig
from bridge.model.dtypes import WEIGHT_DTYPES
from bridge.weights import kinds
from rollout_gpu import adapter_swap
from rollout_gpu import canary as canary_lib
from rollout_gpu.engine import RolloutEngine
from rollout_gpu.served_version import (
    CanaryMismatch,
    EngineVersion,
    WeightSwapError,
    version_canary,
)

__all__ = ["CanaryMismatch", "EngineVersion", "ReloadFailed", "WeightSwapError", "load_version"]

ALLOWED_DTYPES = tuple(WEIGHT_DTYPES)  # ("float32", "bfloat16", "float16")


class ReloadFailed(RuntimeError):
    """The engine's weight load raised; the previous version was restored (see the message)."""


def expected_hf_shapes(engine: RolloutEngine) -> dict[str, tuple[int, ...]]:
    return layouts.hf_shapes(engine.model_config())


def validate_tensors(
    tensors: Mapping[str, np.ndarray], expected_shapes: Mapping[str, tuple[int, ...]]
) -> None:
    """Raise WeightSwapError naming the first problem; checks every array before returning."""
    missing = sorted(set(expected_shapes) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected_shapes))
    if missing or unexpected:
        raise WeightSwapError(
            f"parameter names do not match the engine's model: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''} ({len(missing)}), unexpected "
            f"{unexpected[:5]}{'...' if len(unexpected) > 5 else ''} ({len(unexpected)})"
        )
    for name, shape in expected_shapes.items():
        arr = tensors[name]
        if not isinstance(arr, np.ndarray):
            raise WeightSwapError(f"{name}: expected a numpy array, got {type(arr).__name__}")
        if tuple(arr.shape) != tuple(shape):
            raise WeightSwapError(
                f"{name}: shape {tuple(arr.shape)} does not match the engine's {tuple(shape)}"
            )
        if arr.dtype.name not in ALLOWED_DTYPES:
            raise WeightSwapError(f"{name}: dtype {arr.dtype.name} not in {ALLOWED_DTYPES}")
        if not np.all(np.isfinite(arr)):
            bad = int(np.size(arr) - np.count_nonzero(np.isfinite(arr)))
            raise WeightSwapError(f"{name}: {bad} non-finite values (NaN/inf)")


def to_torch(arr: np.ndarray):
    """numpy (incl. ml_dtypes.bfloat16) -> CPU torch tensor, sharing memory where possible."""
    import torch

    arr = np.ascontiguousarray(arr)
    if not arr.flags.writeable:  # torch.from_numpy warns on read-only buffers (memmaps)
        arr = arr.copy()
    if arr.dtype.name == "bfloat16":
        # numpy has no native bf16; reinterpret the bits through uint16.
        return torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def restore(engine: RolloutEngine, current: EngineVersion) -> None:
    """Reload `current` in full (after a failed reload or a failed canary)."""
    if current.tensors is None:
        try:
            engine.load_weights(None)  # the weights the engine was built with, from its dir
        except NotImplementedError:
            # An engine started on dummy weights (the worker's) has no version to go back
            # to: it stays without one (`current.version` None: the worker does not
            # generate until a version loads), and the caller's error is what is raised.
            pass
    else:
        engine.load_weights([(n, to_torch(a)) for n, a in current.tensors.items()])


def swap_weights(
    engine: RolloutEngine,
    tensors: Mapping[str, np.ndarray],
    expected_shapes: Mapping[str, tuple[int, ...]] | None = None,
    current: EngineVersion | None = None,
    changed: set[str] | None = None,
) -> None:
    """Validate `tensors` (HF name -> array) completely, then reload them in place.

    `changed` (a delta version's tensors that differ from `current`'s): only the engine
    modules holding one of them are reloaded (`reload_names`), the rest keep their memory.
    Refusals raise WeightSwapError before the engine is touched. If the load raises,
    the engine is restored to `current` (default: its initial weights) and ReloadFailed
    is raised with the cause chained.
    """
    if expected_shapes is None:
        expected_shapes = expected_hf_shapes(engine)
    validate_tensors(tensors, expected_shapes)
    names = list(expected_shapes)
    if changed is not None and current is not None and current.version is not None:
        names = reload_names(changed, names)
        if not names:
            return
    # Same order as the engine's parameter table: the engine buffers per layer until a layer
    # is complete, so grouping by layer keeps the extra memory to one layer at a time.
    ordered = [(name, to_torch(tensors[name])) for name in names]
    with _quiet_untouched_layers(len(names) < len(expected_shapes)):
        _reload_or_restore(engine, ordered, current or EngineVersion())


# HF tensors vLLM fuses into one module (its models' `packed_modules_mapping`).
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}  # fmt: skip


def engine_module(name: str) -> str:
    """The engine module an HF tensor loads into ("...self_attn.k_proj.weight" ->
    "...self_attn.qkv_proj"). Every expert of a MoE layer loads into one module (vLLM's
    fused experts hold all E experts' gate/up and down in two tensors), so one changed
    expert reloads them all ("...mlp.experts.7.up_proj.weight" -> "...mlp.experts")."""
    if ".mlp.experts." in name:
        return name.split(".mlp.experts.")[0] + ".mlp.experts"
    module, _, _ = name.rpartition(".")
    parent, _, leaf = module.rpartition(".")
    return f"{parent}.{_FUSED.get(leaf, leaf)}"


def reload_names(changed: set[str], names: list[str]) -> list[str]:
    """The tensors (in `names` order) of every engine module holding a changed tensor.

    vLLM's reload re-materializes a module that receives any tensor and fills it from what it
    received: a module given only some of its tensors (k_proj of a fused qkv_proj) keeps
    uninitialized memory for the rest (vllm_engine.py). So modules go whole or not at all;
    a module that gets nothing keeps its storage, i.e. the current version's values."""
    modules = {engine_module(n) for n in changed}
    return [n for n in names if engine_module(n) in modules]


@contextlib.contextmanager
def _quiet_untouched_layers(partial: bool):
    """vLLM warns "Failed to load weights" for every module a reload does not touch, which
    a delta swap does on purpose: silence that one logger while it runs."""
    if not partial:
        yield
        return
    log = pylogging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    level = log.level
    log.setLevel(pylogging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _reload_or_restore(engine: RolloutEngine, weights, current: EngineVersion) -> None:
    try:
        engine.load_weights(weights)
    except Exception as e:
        try:
            restore(engine, current)
        except Exception as e2:
            raise ReloadFailed(
                f"reload failed ({e!r}) and restoring version {current.version} failed too "
                f"({e2!r}); the engine's weights are undefined"
            ) from e
        raise ReloadFailed(
            f"reload failed ({type(e).__name__}: {e}); restored version {current.version}"
        ) from e


def _check_manifest_config(manifest, cfg: ModelConfig) -> None:
    """Refuse a version published for another architecture (before reading its arrays)."""
    # The store's Manifest keeps the HF config.json dict as `hf_config` (pydantic reserves
    # `model_config`); accept a plain dict of ModelConfig fields as well.
    hf = getattr(manifest, "hf_config", None)
    if not hf:
        return
    try:
        published = ModelConfig.from_hf_dict(dict(hf))
    except (KeyError, TypeError, ValueError):
        try:
            published = ModelConfig(**dict(hf))
        except (TypeError, ValueError) as e:
            raise WeightSwapError(f"manifest model_config is unreadable: {e!r}") from e
    # max_position_embeddings is a serving limit, not part of the weights.
    diff = {
        f.name: (getattr(published, f.name), getattr(cfg, f.name))
        for f in dataclasses.fields(cfg)
        if f.name != "max_position_embeddings"
        and getattr(published, f.name) != getattr(cfg, f.name)
    }
    if diff:
        raise WeightSwapError(
            f"version's model_config differs from the engine's (published, engine): {diff}"
        )


class _EngineSide:
    """`engine` as the version strategies see it (bridge/weights/sides.py `EngineSide`)."""

    def __init__(self, engine: RolloutEngine, current: EngineVersion, require_canary: bool):
        self.engine, self.current, self.require_canary = engine, current, require_canary

    def held(self):
        current = self.current
        return None if current.tensors is None else (current.version, current.tensors)

    def admit_weights(self, version: int, manifest) -> None:
        _check_manifest_config(manifest, self.engine.model_config())
        if self.require_canary and "canary" not in manifest.extra:
            raise WeightSwapError(f"version {version} has no canary in its manifest")

    def swap_tensors(self, version: int, manifest, tensors, changed):
        engine, current = self.engine, self.current
        swap_weights(engine, tensors, layouts.hf_shapes(engine.model_config()), current, changed)
        result = None
        extra = manifest.extra
        if "canary" in extra:
            try:
                result = version_canary(engine, extra["canary"], manifest.dtype)
            except Exception as e:
                restore(engine, current)
                raise WeightSwapError(f"version {version}: canary could not run: {e}") from e
            if not result.ok:
                current.bad_versions.add(version)
                restore(engine, current)  # the new weights loaded fine but are wrong
                raise CanaryMismatch(version, result)
        current.version, current.tensors = version, tensors
        return result

    def serve_adapter(self, version: int, manifest, store):
        engine, current = self.engine, self.current
        return adapter_swap.load_adapter_version(engine, store, version, manifest, current)


def load_version(
    engine: RolloutEngine, store, version: int, current: EngineVersion, require_canary: bool = False
) -> canary_lib.CanaryResult | None:
    """Read, verify, swap in and canary-check `version`; on success update `current`.

    Raises (engine keeps serving `current`): the store's error for a missing manifest or
    a corrupt/truncated array; WeightSwapError for a name/shape/dtype/config mismatch;
    ReloadFailed if the engine's load raised; CanaryMismatch if the engine's log-probs
    disagree with the learner's (the version is added to `current.bad_versions`).
    """
    if version in current.bad_versions:
        raise WeightSwapError(f"version {version} is marked bad on this worker")
    manifest = store.manifest(version)
    side = _EngineSide(engine, current, require_canary)
    return kinds.strategy_of(manifest).load(side, store, version, manifest)
