"""Transactional hot swap of a published weight version into a running vLLM engine.

`load_version` = read the version from the weight store (every checksum verified) ->
validate names, shapes, dtypes and finiteness against the engine's architecture ->
`reload_weights` in place -> per-version canary (`rollout_gpu/canary.py`). Any refusal
leaves the engine serving the previous version; the error names the cause.

Why validation is complete and happens before the engine is touched: vLLM 0.32's
`reload_weights` (model_executor/model_loader/reload) moves every layer to the meta
device, buffers incoming tensors per layer, and re-materializes a layer with
`torch.empty` once it has seen all of that layer's elements. A layer that receives only
some of its tensors (say q_proj but not k/v of the fused qkv) is materialized with
uninitialized memory for the rest; names vLLM does not know raise inside
`load_weights` after earlier layers were already replaced. So a partial or misnamed
version can never be handed to vLLM: we require exactly the engine's HF parameter set.

If the reload itself fails anyway (an I/O error in a streamed iterator, a loader
assertion), we put every layer's original storage back (`_abort_partial_reload`) and
reload the previous version: from the host copy of its tensors we keep (the version
the loader read last), or from the engine's model directory on disk for the initial
weights. Keeping the last version on host costs one model of RAM, which a worker needs
anyway while it reads the next version; it makes rollback independent of store GC.

After every reload (`_reload`) two things vLLM 0.32 does not do are done: the post-load
processing of tied layers is re-run (the CPU backend's prepacked tied lm_head otherwise
keeps the old embedding) and the prefix cache is reset (cached KV blocks of the old
weights would otherwise be reused by generation, which the canary cannot see).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import numpy as np

from bridge.model import layouts
from bridge.model.config import ModelConfig
from rollout_gpu import canary as canary_lib

ALLOWED_DTYPES = ("float32", "bfloat16", "float16")


class WeightSwapError(ValueError):
    """A version was refused before the engine was touched; the engine is unchanged."""


class ReloadFailed(RuntimeError):
    """vLLM's reload raised; the previous version was restored (see the message)."""


class CanaryMismatch(RuntimeError):
    """The engine does not score the probes like the learner: the version is marked bad."""

    def __init__(self, version, result: canary_lib.CanaryResult):
        super().__init__(f"version {version} failed its canary and was rolled back: {result}")
        self.version = version
        self.result = result


@dataclasses.dataclass
class EngineVersion:
    """What the engine serves now, and what is needed to go back to it.

    `tensors` is None for the weights the engine was started with (restored from its
    model directory). `bad_versions` are refused without reading them again.
    """

    version: int | None = None
    tensors: Mapping[str, np.ndarray] | None = None
    bad_versions: set[int] = dataclasses.field(default_factory=set)


def engine_model_config(llm) -> ModelConfig:
    """The architecture the engine runs, from its HF config."""
    mc = llm.llm_engine.model_config
    try:
        return ModelConfig.from_hf_dict(mc.hf_config.to_dict())
    except (KeyError, ValueError):
        return ModelConfig.from_hf_dir(mc.model)


def engine_dtype(llm) -> str:
    return str(llm.llm_engine.model_config.dtype).removeprefix("torch.")


def expected_hf_shapes(llm) -> dict[str, tuple[int, ...]]:
    return layouts.hf_shapes(engine_model_config(llm))


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


def _reload(llm, weights: Iterable[tuple[str, object]] | None) -> None:
    """Reload in place (from the engine's model directory when `weights` is None)."""
    if weights is None:
        llm.collective_rpc("reload_weights")
    else:
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    llm.collective_rpc(_reprocess_tied_layers)
    # Cached KV blocks were computed by the previous weights. Prompt-logprob requests (the
    # canary) never read the prefix cache, but generation does: without this reset a
    # prompt seen before the swap continues from stale KV (measured: first-token logprob
    # off by 0.07 on the tiny Qwen3 with a 200-token prompt).
    if not llm.reset_prefix_cache():
        raise RuntimeError("could not reset vLLM's prefix cache (requests still running)")


def _reprocess_tied_layers(worker) -> int:
    """Runs on each worker: redo post-load processing of layers that share a parameter.

    A tied lm_head shares its weight with embed_tokens, so `reload_weights` sees no tensor
    for it and skips its `process_weights_after_loading`. On vLLM's CPU backend that step
    prepacks the GEMM weight (oneDNN/SGL `cpu_linear`), so the tied lm_head kept scoring
    with the previous version's embedding -- our canary caught this (max |diff| 0.8 on
    the tiny Qwen3). Re-running the step is cheap and a no-op on GPU. Returns the count.
    """
    model = worker.model_runner.get_model()
    owners: dict[int, list] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)
    done = 0
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
                done += 1
    return done


def _abort_partial_reload(worker) -> int:
    """Runs on each worker: undo the layerwise-reload state a failed reload left behind.

    Puts every layer's original (kernel) storage back and unwraps the buffering weight
    loaders, so the next reload starts from a normal model. Values are then a mix of
    old and new and must be overwritten by a full reload. Returns layers repaired.
    """
    from vllm.model_executor.model_loader.reload import layerwise as lw
    from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

    model = worker.model_runner.get_model()
    repaired = 0
    for layer in model.modules():
        info = lw.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue
        if info.kernel_tensors is not None:
            lw._place_kernel_tensors(layer, info)
        for tensor in get_layer_tensors(layer).values():
            if hasattr(tensor, "weight_loader"):
                tensor.weight_loader = lw._get_original_loader(tensor)
        info.reset()
        repaired += 1
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload
    lw.LOADING_LAYERS.clear()
    return repaired


def restore(llm, current: EngineVersion) -> None:
    """Reload `current` in full (after a failed reload or a failed canary)."""
    if current.tensors is None:
        _reload(llm, None)  # the weights the engine was built with, from its model directory
    else:
        _reload(llm, [(n, to_torch(a)) for n, a in current.tensors.items()])


def swap_weights(
    llm,
    tensors: Mapping[str, np.ndarray],
    expected_shapes: Mapping[str, tuple[int, ...]] | None = None,
    current: EngineVersion | None = None,
) -> None:
    """Validate `tensors` (HF name -> array) completely, then reload them in place.

    Refusals raise WeightSwapError before the engine is touched. If vLLM's reload raises,
    the engine is restored to `current` (default: its initial weights) and ReloadFailed
    is raised with the cause chained.
    """
    if expected_shapes is None:
        expected_shapes = expected_hf_shapes(llm)
    validate_tensors(tensors, expected_shapes)
    # Same order as the engine's parameter table: vLLM buffers per layer until a layer is
    # complete, so grouping by layer keeps the extra memory to one layer at a time.
    ordered = [(name, to_torch(tensors[name])) for name in expected_shapes]
    _reload_or_restore(llm, ordered, current or EngineVersion())


def _reload_or_restore(llm, weights, current: EngineVersion) -> None:
    try:
        _reload(llm, weights)
    except Exception as e:
        try:
            llm.collective_rpc(_abort_partial_reload)
            restore(llm, current)
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


def load_version(
    llm, store, version: int, current: EngineVersion, require_canary: bool = False
) -> canary_lib.CanaryResult | None:
    """Read, verify, swap in and canary-check `version`; on success update `current`.

    Raises (engine keeps serving `current`): the store's error for a missing manifest or
    a corrupt/truncated array; WeightSwapError for a name/shape/dtype/config mismatch;
    ReloadFailed if vLLM's reload raised; CanaryMismatch if the engine's log-probs
    disagree with the learner's (the version is added to `current.bad_versions`).
    """
    if version in current.bad_versions:
        raise WeightSwapError(f"version {version} is marked bad on this worker")
    manifest = store.manifest(version)
    cfg = engine_model_config(llm)
    _check_manifest_config(manifest, cfg)
    extra = dict(getattr(manifest, "extra", None) or {})
    if require_canary and "canary" not in extra:
        raise WeightSwapError(f"version {version} has no canary in its manifest")
    tensors = store.read_all(version)  # verifies every checksum before returning
    swap_weights(llm, tensors, layouts.hf_shapes(cfg), current)
    result = None
    if "canary" in extra:
        both_fp32 = manifest.dtype == "float32" and engine_dtype(llm) == "float32"
        try:
            result = canary_lib.check_canary(
                llm, extra["canary"], "float32" if both_fp32 else "bfloat16"
            )
        except Exception as e:
            restore(llm, current)
            raise WeightSwapError(f"version {version}: canary could not run: {e}") from e
        if not result.ok:
            current.bad_versions.add(version)
            restore(llm, current)  # the new weights loaded fine but are wrong
            raise CanaryMismatch(version, result)
    current.version, current.tensors = version, tensors
    return result
