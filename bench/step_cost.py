"""What a learner train step costs: its model FLOPs, the chip's peak FLOP/s (vendor spec or
a measured matmul), and peak memory (the device allocator's, XLA's plan, the host's RSS).

Model FLOPs per step (PaLM appendix B convention, causal attention counted in full):
    6 * tokens * (matmul params, lm head included) + 12 * layers * tokens * seq_len * N * H
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from bridge.model.config import ModelConfig

# Dense bf16 peak FLOP/s per chip (vendor spec sheets, no sparsity). Matched as substrings
# of `device_kind` in this order, so "H100 PCIe" is tried before "H100", "L40S" before "L4".
PEAK_BF16 = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,  # SXM
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 125e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v4": 275e12,
    "TPU v6 lite": 918e12,
}


def model_flops_per_step(cfg: ModelConfig, batch: int, seq_len: int) -> float:
    d, f, n, k, h = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
    )
    per_layer = d * (n + 2 * k) * h + n * h * d + 3 * d * f  # q,k,v,o + gate,up,down
    matmul_params = cfg.num_layers * per_layer + d * cfg.vocab_size  # + lm head
    tokens = batch * seq_len
    return 6.0 * tokens * matmul_params + 12.0 * cfg.num_layers * tokens * seq_len * n * h


def spec_peak_flops(devices=None) -> tuple[float | None, str]:
    """(dense bf16 peak FLOP/s of `devices` from PEAK_BF16, source); None off the table."""
    devices = devices or jax.devices()
    kind = devices[0].device_kind
    if devices[0].platform == "cpu":
        return None, "no spec peak for a CPU"
    for name, peak in PEAK_BF16.items():
        if name.lower() in kind.lower():
            return peak * len(devices), f"spec:{kind}"
    return None, f"unknown chip {kind}"


def measured_matmul_flops(dtype, n: int, reps: int = 5, chain: int = 8) -> float:
    """FLOP/s of [n, n] @ [n, n] matmuls in `dtype` on the default device: the best of `reps`
    timings of one jitted chain of `chain` dependent matmuls (the chain amortizes the
    dispatch and the host's timer over several kernels).

    Random operands, not constants: a chip's clock (and so its throughput) can depend on how
    many bits toggle. b's entries have variance 1/n, so x @ b keeps x's scale along the chain.
    """
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = (jax.random.normal(jax.random.key(1), (n, n), jnp.float32) * n**-0.5).astype(dtype)
    mm = jax.jit(lambda a, b: jax.lax.fori_loop(0, chain, lambda _, x: x @ b, a))
    mm(a, b).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        mm(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 * chain / best


def peak_flops(dtype) -> tuple[float, str]:
    """The chip's spec peak on an accelerator; on CPU a measured 2048^3 matmul in `dtype`."""
    peak, source = spec_peak_flops()
    if peak is not None:
        return peak, source
    if jax.devices()[0].platform != "cpu":
        return float("nan"), source
    return measured_matmul_flops(dtype, 2048, chain=1), "measured_matmul"


def device_peak_bytes(device=None) -> tuple[int | None, str]:
    """(the allocator's `peak_bytes_in_use`, why None where the backend reports none).

    A high-water mark of the whole process since the backend started: it never goes down.
    """
    device = device or jax.devices()[0]
    stats = device.memory_stats()
    if not stats or "peak_bytes_in_use" not in stats:
        return None, f"{device.platform} backend reports no allocator statistics"
    return int(stats["peak_bytes_in_use"]), "memory_stats.peak_bytes_in_use"


def compiled_bytes(compiled) -> int | None:
    """XLA's buffer plan for one call of a compiled executable: arguments + outputs - donated
    (aliased) + temporaries. None where the backend gives no memory analysis."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    return int(
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )


def host_peak_gb() -> float:
    """The process's peak resident memory (VmHWM), GiB."""
    with open("/proc/self/status") as f:
        hwm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return hwm_kb / 2**20


def peak_memory_gb() -> dict:
    """Peak device memory (where the backend reports it) and peak host RSS, in GiB."""
    device, _ = device_peak_bytes()
    return {
        "peak_device_gb": None if device is None else device / 2**30,
        "peak_host_gb": host_peak_gb(),
    }
