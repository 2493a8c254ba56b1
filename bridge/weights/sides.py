"""What the two stacks offer the version strategies (bridge/weights/kinds.py).

A strategy decides what a version of its kind is made of and how it is written and
loaded; the framework work is done by the side that calls it. The learner implements
`LearnerSide` (learner_jax/publish.py: JAX arrays to HF tensors, the canary forward, the
multi-process publish); a worker implements `EngineSide` and `EngineStarter`
(rollout_gpu/weight_swap.py, rollout_gpu/worker.py: tensors into vLLM, adapters as LoRA
requests). Each side offers every capability and never asks which kind it serves: the
strategy calls the ones its kind needs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Protocol

import numpy as np


class LearnerSide(Protocol):
    processes: int  # learner processes publishing together (each writes its own shards)
    dtype: str  # the stored dtype of the policy (bridge.publish_dtype)
    param_dtype: str  # the dtype the learner trains in (a LoRA base is stored in it)
    hf_dir: str  # the model files workers start from
    step: int

    def hf_config(self) -> dict: ...
    def policy_params(self) -> Any: ...
    def publishable(self, params) -> Any:
        """`params` in the stored dtype (the canary scores what workers load)."""

    def canary(self, params) -> dict: ...
    def hf_sources(self, params) -> Iterator[tuple[str, Any]]:
        """(HF name, ShardedSource) per tensor, streaming this process's shards."""

    def publish_full(self, store, version: int, params, extra: Mapping, dtype: str = ""):
        """Every process together (each its shards); returns the manifest."""

    # LoRA: the trained adapters over a frozen base
    def lora_reference(self) -> dict: ...
    def adapter_params(self) -> Any: ...
    def frozen_params(self) -> Any: ...
    def peft_tensors(self, adapters) -> dict[str, np.ndarray]: ...
    def adapter_config(self, base_model: str | None) -> dict: ...
    def policy_from_peft(self, version: int, tensors: Mapping[str, np.ndarray]) -> Any:
        """The merged policy of stored adapter tensors, laid out like the learner's."""


class EngineSide(Protocol):
    def held(self) -> tuple[int, Mapping[str, np.ndarray]] | None:
        """(version, tensors) the engine serves, when the worker keeps them on host."""

    def admit_weights(self, version: int, manifest) -> None:
        """Refuse (WeightSwapError) weights for another architecture, before any read."""

    def swap_tensors(self, version: int, manifest, tensors, changed: set[str] | None):
        """Validate, reload (only the modules of `changed`, None = all), canary-check."""

    def serve_adapter(self, version: int, manifest, store):
        """Add adapter `version` beside the resident ones, make it active, canary-check."""


class EngineStarter(Protocol):
    def plain(self, model_dir: str): ...
    def with_adapters(self, base) -> Any:
        """A LoRA-enabled engine over `base` (bridge/weights/adapter.py `LoraBase`)."""
