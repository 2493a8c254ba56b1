"""The experts vLLM routed each token to, captured inside the engine's forward pass.

    engine.llm.collective_rpc(install, args=(moe_layers,))   # VllmEngine.start does this
    rows = engine.llm.collective_rpc(take, args=(internal_request_ids,))[0]

vLLM 0.32 has its own capture (`enable_return_routed_experts`, returned per request as
`CompletionOutput.routed_experts`), but it cannot run with our engine: it needs vLLM's v2
model runner ("AuxOutput Connector requires Model Runner V2; set
VLLM_USE_V2_MODEL_RUNNER=1"), the v2 runner needs Triton ("Model Runner V2 requires
Triton", so never on this CPU), and the verifiable sampler (verifiable_sampler.py) replaces
the v1 runner's sampler. So we use vLLM's own capture *point* -- every MoE router calls
`capture_fn(topk_ids)` with the logical expert ids, before any expert-parallel remapping
(`BaseRouter.select_experts`), the hook vLLM's capturer binds to -- with a recorder of our
own that works on the v1 runner.

Each forward step the router of every sparse layer hands us `topk_ids` [tokens, k] for the
step's flattened tokens; after the step the recorder splits them by request (the input
batch's order and `query_start_loc`, as the runner laid them out) and files each row under
its request and its absolute position in the sequence. A chunked prefill, or a request
preempted and recomputed, therefore lands in the right rows (a recompute overwrites with
the same weights' routing).

What a sequence gets: one row per position that was forwarded, 0 .. P + C - 2 for P prompt
and C completion tokens (the last sampled token is never fed back). Row j is the routing of
token j as the model's input, whose output predicts token j + 1: completion token i was
produced by row P - 1 + i. A prefix-cache hit skips the forward of cached prompt blocks, so
an engine that records routing runs without prefix caching (VllmEngine.start); a position
left unrecorded is -1 and the caller refuses the sample (never a silent guess).

Rows are int16 (expert ids < 2^15; Qwen3-30B-A3B has 128 experts), [positions, L, k] with
L the model's sparse layers in order (`ModelConfig.moe_layers`).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

MISSING = -1  # a position whose routing was never recorded


class RoutingRecorder:
    """Per-request routing rows, filled by the routers' capture hooks during forwards."""

    def __init__(self, runner, moe_layers: list[int], k: int):
        self._runner = weakref.ref(runner)
        self.slot = {int(layer): j for j, layer in enumerate(moe_layers)}
        self.k = int(k)
        self.step: dict[int, torch.Tensor] = {}  # layer slot -> this forward's topk_ids
        self.rows: dict[str, np.ndarray] = {}  # internal request id -> [positions, L, k]

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        slot = self.slot.get(int(layer_id))
        if slot is None:
            raise RuntimeError(
                f"routing capture: MoE router of layer {layer_id}, not a sparse layer of the "
                f"config ({sorted(self.slot)})"
            )
        self.step[slot] = topk_ids.detach().clone()

    def file_step(self, positions: torch.Tensor | None) -> None:
        """After one forward: file its rows under each scheduled request and position."""
        captured, self.step = self.step, {}
        runner = self._runner()
        batch = runner.input_batch
        num_reqs = int(batch.num_reqs)
        if not captured or num_reqs == 0 or positions is None:
            return  # a dummy/profiling forward: no request to file under
        if len(captured) != len(self.slot):
            raise RuntimeError(
                f"routing capture: {len(captured)} of {len(self.slot)} sparse layers routed"
            )
        starts = runner.query_start_loc.np[: num_reqs + 1].astype(np.int64)
        total = int(starts[-1])
        # [tokens, L, k]: one copy to the host per step, not one per layer.
        step = torch.stack([captured[j][:total] for j in range(len(self.slot))], dim=1)
        step = step.to("cpu").numpy()
        pos = positions[:total].to("cpu").numpy().astype(np.int64)
        if step.shape != (total, len(self.slot), self.k):
            raise RuntimeError(f"routing capture: step rows {step.shape}, want ({total}, L, k)")
        for i, req_id in enumerate(batch.req_ids[:num_reqs]):
            lo, hi = int(starts[i]), int(starts[i + 1])
            if hi == lo:
                continue
            p = pos[lo:hi]
            rows = self.rows.get(req_id)
            need = int(p.max()) + 1
            if rows is None or rows.shape[0] < need:
                grown = np.full((max(need, 64), len(self.slot), self.k), MISSING, np.int16)
                if rows is not None:
                    grown[: rows.shape[0]] = rows
                rows = self.rows[req_id] = grown
            rows[p] = step[lo:hi]

    def take(self, req_id: str, length: int) -> np.ndarray:
        """The first `length` positions' rows of a request (MISSING where none), forgotten."""
        rows = self.rows.pop(req_id, None)
        out = np.full((length, len(self.slot), self.k), MISSING, np.int16)
        if rows is not None:
            n = min(length, rows.shape[0])
            out[:n] = rows[:n]
        return out


def _recorder(worker) -> RoutingRecorder:
    rec = getattr(worker.model_runner, "_echo2_routing", None)
    if rec is None:
        raise RuntimeError("routing capture is not installed on this engine")
    return rec


def install(worker, moe_layers: list[int], k: int) -> int:
    """Runs on each worker (`collective_rpc`): bind a recorder to every MoE router and wrap
    the runner's forward so each step's rows are filed. Idempotent; returns routers bound."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

    runner = worker.model_runner
    if getattr(runner, "_echo2_routing", None) is not None:
        return len(runner._echo2_routing.slot)
    if not hasattr(runner, "query_start_loc") or not hasattr(runner, "input_batch"):
        raise RuntimeError(
            f"{type(runner).__name__} has no query_start_loc / input_batch (vLLM 0.32's v1 "
            "model runner): routing capture cannot be installed"
        )
    rec = RoutingRecorder(runner, moe_layers, k)
    bound = []
    for module in runner.get_model().modules():
        if not isinstance(module, MoERunner):
            continue
        if not isinstance(module.router, BaseRouter):
            raise RuntimeError(f"routing capture: unsupported router {type(module.router)}")
        layer_id = int(module.layer_id)
        module.router.set_capture_fn(lambda ids, _layer=layer_id: rec.capture(_layer, ids))
        bound.append(layer_id)
    if sorted(bound) != sorted(rec.slot):
        raise RuntimeError(
            f"routing capture: the engine's MoE layers {sorted(bound)} are not the config's "
            f"sparse layers {sorted(rec.slot)}"
        )
    forward = runner._model_forward

    def recorded_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        rec.file_step(kwargs.get("positions"))
        return out

    runner._model_forward = recorded_forward
    runner._echo2_routing = rec
    return len(bound)


def take(worker, requests: list[tuple[str, int]]) -> list[np.ndarray]:
    """Runs on each worker: the rows of each (internal request id, length), forgotten."""
    rec = _recorder(worker)
    return [rec.take(req_id, length) for req_id, length in requests]


def clear(worker) -> int:
    """Runs on each worker: forget every request's rows (aborted or dropped requests)."""
    rec = _recorder(worker)
    n = len(rec.rows)
    rec.rows.clear()
    rec.step.clear()
    return n
