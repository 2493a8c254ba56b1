"""Learner train-step benchmark: tokens/s and model FLOPs utilization for Qwen3-0.6B shapes.

A Qwen3-0.6B-shaped policy (vocab 151936, hidden 1024, mlp 3072, 28 layers, 16 heads, 8 kv
heads, head_dim 128, tied, q/k norm) with random weights, one full RL train step (GRPO
loss, micro-batched forward + backward, global-norm clip, AdamW) on random token rows.

    python -m bench.learner --out=/tmp/bench_learner.json \
        [--num_layers=28 --batch=8 --seq_len=512 --micro_batches=1 --dtype=bfloat16]

Parameters are fp32 master weights (`--param_dtype`); the step computes in `--dtype`
(bfloat16 on accelerators, the learner's default for real models). Peak memory: the
accelerator's `peak_bytes_in_use` where the backend reports it (GPU/TPU), and the
process's peak host RSS (VmHWM) always.

Model FLOPs per step (PaLM appendix B convention, causal attention counted in full):
    6 * tokens * (matmul params, lm head included) + 12 * layers * tokens * seq_len * N * H
MFU = model FLOP/s / peak. On GPU/TPU the peak is the chip's dense bf16 number from the
table below. On CPU there is no meaningful spec peak, so the figure is relative: the
step's FLOP/s divided by the FLOP/s of one large fp32 matmul measured on the same
machine just before (reported as `peak_source: measured_matmul`).
"""

from __future__ import annotations

import json
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from bridge.model.config import ModelConfig
from bridge.model.presets import qwen3_0p6b
from learner_jax import losses, optim, sharding, train_state, train_step

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "JSON file for the results.", required=True)
flags.DEFINE_integer("num_layers", 28, "Decoder layers (28 = Qwen3-0.6B).")
flags.DEFINE_integer("batch", 8, "Rows per train step (global batch).")
flags.DEFINE_integer("seq_len", 512, "Tokens per row.")
flags.DEFINE_integer("micro_batches", 1, "Gradient-accumulation micro-batches per step.")
flags.DEFINE_string("dtype", None, "Compute dtype (default bfloat16 on accelerators, else fp32).")
flags.DEFINE_string("param_dtype", "float32", "Master-weight dtype (the optimizer's).")
flags.DEFINE_integer("steps", 3, "Timed steps (median reported) after one warm-up step.")
flags.DEFINE_string("mesh", "data=-1", "Mesh, e.g. 'data=2,fsdp=2,tensor=2'; -1 fills.")

# Dense bf16 peak FLOP/s per chip (vendor spec sheets, no sparsity).
PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,
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


def peak_flops(dtype) -> tuple[float, str]:
    dev = jax.devices()[0]
    if dev.platform != "cpu":
        for name, peak in PEAK_BF16.items():
            if name.lower() in dev.device_kind.lower():
                return peak * len(jax.devices()), f"spec:{dev.device_kind}"
        return math.nan, f"unknown chip {dev.device_kind}"
    n = 2048  # one big matmul in the step's compute dtype: what this CPU sustains
    a = jnp.ones((n, n), dtype)
    mm = jax.jit(lambda x: x @ x)
    mm(a).block_until_ready()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        mm(a).block_until_ready()
        times.append(time.perf_counter() - t0)
    return 2.0 * n**3 / min(times), "measured_matmul"


def parse_mesh(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(",") if kv)}


def peak_memory_gb() -> dict:
    """Peak device memory (where the backend reports it) and peak host RSS, in GiB."""
    stats = jax.devices()[0].memory_stats() or {}
    device = stats.get("peak_bytes_in_use")
    with open("/proc/self/status") as f:
        hwm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return {
        "peak_device_gb": None if device is None else device / 2**30,
        "peak_host_gb": hwm_kb / 2**20,
    }


def main(argv):
    del argv
    on_cpu = jax.devices()[0].platform == "cpu"
    dtype = FLAGS.dtype or ("float32" if on_cpu else "bfloat16")
    cfg = qwen3_0p6b(FLAGS.num_layers)
    mesh = sharding.make_mesh(parse_mesh(FLAGS.mesh))
    opt = optim.make_optimizer(
        optim.OptimizerConfig(learning_rate=1e-6, warmup_steps=0, total_steps=100)
    )
    pdt = jnp.dtype(FLAGS.param_dtype)
    state = train_state.create_train_state(cfg, opt, mesh, seed=0, param_dtype=pdt)
    _, shardings = train_state.state_shardings(cfg, opt, mesh, param_dtype=pdt)
    step_cfg = train_step.StepConfig(
        kind="rl",
        loss=losses.LossConfig(name="grpo"),
        micro_batches=FLAGS.micro_batches,
        dtype=dtype,
    )
    step = train_step.jit_step(cfg, opt, step_cfg, mesh, shardings)

    b, t = FLAGS.batch, FLAGS.seq_len
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, cfg.vocab_size, (b, t + 1))
    loss_mask = np.zeros_like(tokens)
    loss_mask[:, t // 4 :] = 1  # a quarter prompt, the rest completion
    batch = train_step.put_batch(
        train_step.make_batch(
            tokens,
            loss_mask,
            valid=np.ones_like(tokens, bool),
            behavior_logp=-12.0 + rng.standard_normal((b, t)),
            advantages=rng.standard_normal(b),
        ),
        mesh,
    )
    t0 = time.perf_counter()
    state, m = step(state, batch)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(FLAGS.steps):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    flops = model_flops_per_step(cfg, b, t)
    peak, peak_source = peak_flops(jnp.dtype(dtype))
    result = {
        "model": "Qwen3-0.6B shapes",
        "num_layers": cfg.num_layers,
        "params": int(sum(x.size for x in jax.tree.leaves(state.params))),
        "batch": b,
        "seq_len": t,
        "micro_batches": FLAGS.micro_batches,
        "dtype": dtype,
        "param_dtype": FLAGS.param_dtype,
        "mesh": dict(mesh.shape),
        "devices": f"{len(jax.devices())} x {jax.devices()[0].device_kind}",
        "compile_plus_first_step_s": compile_s,
        "step_s": step_s,
        "tokens_per_s": b * t / step_s,
        "model_flops_per_step": flops,
        "model_flops_per_s": flops / step_s,
        "peak_flops_per_s": peak,
        "peak_source": peak_source,
        "mfu": flops / step_s / peak,
        "mfu_kind": "relative to measured matmul" if on_cpu else "vs chip spec peak",
        "loss": float(m["loss"]),
        **peak_memory_gb(),
    }
    print(f"{'metric':<28}value")
    for k, v in result.items():
        print(f"{k:<28}{v:.4g}" if isinstance(v, float) else f"{k:<28}{v}")
    with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    app.run(main)
