"""What a worker's engine serves, and how a version it was handed is refused.

Shared by both loaders of a version (rollout_gpu/weight_swap.py: tensors reloaded in place;
rollout_gpu/adapter_swap.py: a LoRA adapter added beside the base), so a refusal reads the
same whatever the version's kind, and neither loader imports the other.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np

from rollout_gpu import canary as canary_lib


class WeightSwapError(ValueError):
    """A version was refused before the engine was touched; the engine is unchanged."""


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
    model directory), and for an adapter version (the base stays loaded). `bad_versions`
    are refused without reading them again.
    """

    version: int | None = None
    tensors: Mapping[str, np.ndarray] | None = None
    bad_versions: set[int] = dataclasses.field(default_factory=set)


def version_canary(engine, payload, published_dtype: str) -> canary_lib.CanaryResult:
    """The engine's log-probs of the learner's probes, compared at fp32 thresholds when
    both the version and the engine are fp32, else at bf16 ones."""
    both_fp32 = published_dtype == "float32" and engine.dtype == "float32"
    return canary_lib.check_canary(engine, payload, "float32" if both_fp32 else "bfloat16")
