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
table in bench/step_cost.py. On CPU there is no meaningful spec peak, so the figure is relative: the
step's FLOP/s divided by the FLOP/s of one large fp32 matmul measured on the same
machine just before (reported as `peak_source: measured_matmul`).
"""

from __future__ import annotations

import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from bench import rl_step, step_cost
from bridge.model.presets import qwen3_0p6b
from learner_jax.model import sharding
from learner_jax.training import train_step

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


def parse_mesh(text: str) -> dict[str, int]:
    return {k: int(v) for k, v in (kv.split("=") for kv in text.split(",") if kv)}


def main(argv):
    del argv
    on_cpu = jax.devices()[0].platform == "cpu"
    dtype = FLAGS.dtype or ("float32" if on_cpu else "bfloat16")
    cfg = qwen3_0p6b(FLAGS.num_layers)
    mesh = sharding.make_mesh(parse_mesh(FLAGS.mesh))
    state, step = rl_step.build(
        cfg, mesh, dtype, micro_batches=FLAGS.micro_batches, param_dtype=FLAGS.param_dtype
    )
    b, t = FLAGS.batch, FLAGS.seq_len
    batch = train_step.put_batch(rl_step.random_batch(cfg, b, t, np.random.default_rng(0)), mesh)
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
    flops = step_cost.model_flops_per_step(cfg, b, t)
    peak, peak_source = step_cost.peak_flops(jnp.dtype(dtype))
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
        **step_cost.peak_memory_gb(),
    }
    print(f"{'metric':<28}value")
    for k, v in result.items():
        print(f"{k:<28}{v:.4g}" if isinstance(v, float) else f"{k:<28}{v}")
    with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    app.run(main)
