"""The run's dtypes: the compute dtype of the forward and the dtype versions are published
in. Master weights (what the optimizer updates) stay in `model.param_dtype`."""

from __future__ import annotations

_DTYPES = ("float32", "bfloat16", "float16")


def compute_dtype(config) -> str:
    """`model.dtype`; 'auto' = bfloat16 compute for a real model (`model.hf_dir` set) and
    float32 for the tiny demo model. Parameters (the master weights the optimizer updates)
    stay in `model.param_dtype` (float32 by default) either way: every matmul casts them
    to the compute dtype, so bf16 runs keep fp32 updates exact (no lost small steps)."""
    dtype = config.model.dtype
    if dtype == "auto":
        return "bfloat16" if config.model.hf_dir else "float32"
    if dtype not in _DTYPES:
        raise ValueError(f"model.dtype must be auto|float32|bfloat16|float16, got {dtype!r}")
    return dtype


def publish_dtype(config) -> str:
    """`bridge.publish_dtype`, the dtype versions are stored in (what workers load). 'auto' =
    the compute dtype: the forward casts the master weights to it anyway, so a bf16 run's
    workers get exactly the weights the learner computes with, at half the bytes of fp32
    masters, and a small RL step changes few bf16 elements (delta versions pay; fp32 masters
    change in nearly every element every step, so every delta tensor would go dense)."""
    dtype = str(config.bridge.get("publish_dtype", "auto"))
    if dtype == "auto":
        return compute_dtype(config)
    if dtype not in _DTYPES:
        raise ValueError(
            f"bridge.publish_dtype must be auto|float32|bfloat16|float16, got {dtype!r}"
        )
    return dtype
