"""LoRA adapter versions on a vLLM worker: the base model loaded once, each adapter version
added at runtime (vLLM `LoRARequest`), the newest `keep` (>= S + 1) resident, the oldest
evicted, and generation / prompt log-probs under a chosen adapter version.

Adapter versions come from the adapter sub-store (bridge/weights/adapter_store.py), read and
verified chunk by chunk against their manifest, written as a PEFT directory under
`cache_dir/v{version}` and handed to the engine; eviction takes the earliest added (a
rerun learner's rollback announces a lower number later); a resident version whose manifest
changed (the rerun published that number again) is reloaded. A version whose manifest names another
base model (its HF config differs from the engine's in any architecture field) is refused
before anything is loaded.

vLLM (CPU build 0.32.0 here, and CUDA builds) serves LoRA when the engine is started with
`enable_lora=True`, `max_loras` >= the adapters one batch may mix and `max_lora_rank` >=
the adapter rank (`start_lora_engine`). Adapter ids are version + 1 (vLLM wants ids > 0).
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Sequence
from typing import Any

import numpy as np

from bridge.store.weight_store import WeightStore
from bridge.weights import adapter_store
from rollout_gpu.vllm_engine import VllmEngine, on_cpu

# HF config fields that must agree between the adapter's base and the served model.
_ARCH_FIELDS = (
    "model_type",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
)
_VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted max_lora_rank values


def start_lora_engine(
    model_dir: str, max_loras: int, max_lora_rank: int, **kwargs: Any
) -> VllmEngine:
    """A `VllmEngine` that serves LoRA adapters (fp32, eager, as `VllmEngine.start`)."""
    from vllm import LLM

    rank = next((r for r in _VLLM_RANKS if r >= max_lora_rank), None)
    if rank is None:
        raise ValueError(f"adapter rank {max_lora_rank} exceeds vLLM's largest {_VLLM_RANKS[-1]}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    opts = {
        "dtype": "float32",
        "max_model_len": 512,
        "seed": 0,
        "enforce_eager": True,
        "logprobs_mode": "processed_logprobs",
    }
    opts.update(kwargs)
    if on_cpu():
        opts.setdefault("gpu_memory_utilization", 0.1)
    llm = LLM(
        model=model_dir,
        enable_lora=True,
        max_loras=max_loras,
        max_cpu_loras=max_loras,
        max_lora_rank=rank,
        **opts,
    )
    return VllmEngine(llm)


class AdapterServer:
    """Adapter versions resident in one LoRA-enabled engine (newest `keep`)."""

    def __init__(
        self, engine: VllmEngine, store: WeightStore, cache_dir: str, keep: int, spare: int = 0
    ):
        """`spare`: room for that many more until `trim` (a worker loads a new version
        beside its `keep` ones, and trims once the new one passed its canary)."""
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (S + 1 adapter versions), got {keep}")
        self.engine, self.store, self.cache_dir, self.keep = engine, store, cache_dir, keep
        self.spare = spare
        self._resident: dict[int, Any] = {}  # version -> LoRARequest
        self._identity: dict[int, str] = {}  # version -> SHA-256 of the manifest it came from

    @property
    def resident(self) -> list[int]:
        return sorted(self._resident)

    def request(self, version: int, store: WeightStore | None = None):
        """The `LoRARequest` of `version`, fetching, verifying and adding it if needed (from
        `store`, default the server's: a worker passes the route of each announcement)."""
        from vllm.lora.request import LoRARequest

        store = store or self.store
        manifest = adapter_store.adapter_manifest(store, version)
        identity = hashlib.sha256(manifest.model_dump_json().encode()).hexdigest()
        republished = version in self._resident and self._identity[version] != identity
        if republished:  # a rerun learner published this number again, with other weights
            self._evict(version)
        elif version in self._resident:
            return self._resident[version]
        served = self.engine.hf_config
        diff = {
            k: (manifest.hf_config.get(k), served.get(k))
            for k in _ARCH_FIELDS
            if manifest.hf_config.get(k) != served.get(k)
        }
        if diff:
            raise ValueError(f"adapter version {version} is for another base model: {diff}")
        path = adapter_store.fetch_adapter_dir(
            store, version, os.path.join(self.cache_dir, f"v{version}")
        )
        req = LoRARequest(f"v{version}", version + 1, path)
        if not self.engine.llm.llm_engine.add_lora(req):
            raise RuntimeError(f"vLLM refused adapter version {version}")
        self._resident[version] = req
        self._identity[version] = identity
        if republished and not self.engine.llm.reset_prefix_cache():
            # vLLM keys cached KV by adapter name + path, which the new weights share
            raise RuntimeError("could not reset vLLM's prefix cache (requests still running)")
        self.trim(version, self.keep + self.spare)
        return req

    def trim(self, newest: int, keep: int | None = None) -> None:
        """Evict the earliest added (never `newest`) down to `keep` (default: `self.keep`)."""
        while len(self._resident) > (self.keep if keep is None else keep):
            self._evict(next(v for v in self._resident if v != newest))

    def drop(self, version: int) -> None:
        """Unload `version` (one that failed its canary)."""
        if version in self._resident:
            self._evict(version)

    def _evict(self, version: int) -> None:
        req = self._resident.pop(version)
        self._identity.pop(version, None)
        self.engine.llm.llm_engine.remove_lora(req.lora_int_id)
        shutil.rmtree(req.lora_path, ignore_errors=True)

    def loaded_ids(self) -> set[int]:
        """Adapter ids the engine itself holds (what eviction is checked against)."""
        return set(self.engine.llm.llm_engine.list_loras())

    def prompt_logprobs(self, version: int, token_lists: Sequence[Sequence[int]]):
        """log p(token j | tokens < j) for j >= 1 under adapter `version` (the canary's
        measurement, compared with the learner's LoRA log-probs)."""
        from vllm import SamplingParams

        req = self.request(version)
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        prompts = [{"prompt_token_ids": [int(t) for t in ids]} for ids in token_lists]
        outs = self.engine.llm.generate(prompts, params, lora_request=req, use_tqdm=False)
        result = []
        for ids, out in zip(token_lists, outs, strict=True):
            lps = [out.prompt_logprobs[j][int(t)].logprob for j, t in enumerate(ids) if j > 0]
            result.append(np.asarray(lps, dtype=np.float64))
        return result

    def generate(self, version: int, token_lists: Sequence[Sequence[int]], params) -> list:
        """vLLM outputs of `token_lists` sampled under adapter `version`; each output's
        `lora_request.lora_name` is the version tag 'v{version}'."""
        req = self.request(version)
        prompts = [{"prompt_token_ids": [int(t) for t in ids]} for ids in token_lists]
        return self.engine.llm.generate(prompts, params, lora_request=req, use_tqdm=False)
