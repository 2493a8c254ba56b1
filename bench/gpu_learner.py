"""The learner on an accelerator: train-step MFU at Qwen3-0.6B and Qwen3-1.7B shapes, the
cuDNN (GPU) or splash (TPU) attention against the XLA path, peak device memory against
sequence length, and the time to publish a version to a local file store.

On a GPU machine, from the repo root (one command; the JSON is rewritten after every phase,
so a run cut short keeps what it measured, with `"complete": false`):

    python -m bench.gpu_learner --out=/tmp/gpu_learner.json --compile_cache=/tmp/jax_cache

The lent GPU machine (one H100 80 GB) has CUDA JAX, flax, optax, orbax, tensorstore, torch,
transformers, Python 3.12, no vLLM and no internet. This bench imports neither torch nor
vllm. Only its publish phase needs more (blake3 and pydantic, for the weight store); where
they are missing that phase records an ImportError row and the rest runs. To have it, carry
wheels fetched beforehand on a machine with a registry:

    pip download --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_17_x86_64 -d wheels blake3 pydantic
    # on the GPU machine, before the bench:
    pip install --no-index --find-links wheels blake3 pydantic

Not yet run on a GPU. Its plan for a few minutes of an H100: 12 train-step compiles at 4
or 8 layers (8 memory points, 4 MFU points), two full-depth parameter inits, about 16
small attention programs. The wall time of each phase is printed and stored (`wall_s`);
`--compile_cache` lets a rerun reuse the compiles (its `compile_s` then times the cache).

Its reduced form runs anywhere (tests/bench/gpu_learner_test.py runs it on CPU):

    python -m bench.gpu_learner --reduced --out=/tmp/gpu_learner_reduced.json

Random weights, the real vocabulary (151936), fp32 master weights, bf16 compute, one
device. What it measures (rows by `kind`, headline keys in brackets):

- matmul: bf16 [n, n] @ [n, n] FLOP/s (`--matmul_n`), best of five timings of a chain of
  eight dependent matmuls in one jitted call (bench/step_cost.py).
- mfu [`mfu_0p6b`, `mfu_1p7b`]: the jitted RL train step (GRPO, chunked log-prob head,
  attention "auto" = cuDNN flash on GPU, AdamW) on `--batch` x `--seq_len` random tokens,
  median of `--steps` steps after the compile. Model FLOPs (bench/step_cost.py) / step
  time, divided by the measured matmul FLOP/s (the headline) and by the chip's spec peak
  where bench/step_cost.py knows the chip (`mfu_*_vs_spec`).
  Per-layer extrapolation: the model is unrolled (a Python loop over layers), so compile
  time grows with depth; by default the step runs at `--mfu_layers` = 4 and 8 layers,
  its time is fitted linearly in the layer count (embedding, head and optimizer are the
  intercept, one layer the slope) and taken at 28 layers (`--full_layers`). Rows say
  `extrapolated`. Passing a list that includes 28 measures it directly instead.
- memory [`peak_gb_8k_0p6b`]: one RL step on one row of T tokens, T in
  `--memory_seq_lens`, 0.6B shapes: the allocator's `peak_bytes_in_use`, and XLA's buffer
  plan for the step (`xla_plan_gb`: arguments + outputs - donated + temporaries). The
  allocator's peak is a high-water mark of the whole process, so each layer count of
  `--memory_layers` runs in a fresh subprocess (before this process touches the device)
  with T ascending, where each reading is that T's peak (the compile runs before the step
  and its autotuning allocates from the same pool, so a reading is an upper bound).
  Extrapolated to 28 layers by the same linear fit as the MFU unless 28 is in the list.
  A backend without allocator statistics (CPU) reports null and says why; XLA's plan is
  still given.
- attention [`cudnn_attention_max_rel_err`]: bench/attention_accuracy.py at
  `--attention_seq_lens` with 16 heads, 8 kv heads, head dim 128; values and gradients
  of the cuDNN, XLA-bf16 and blockwise paths against the XLA path in fp32 (highest
  precision), itself checked against float64 numpy up to `--numpy_max_len`. No cuDNN on
  CPU: the key is null there, and the XLA path against float64 is what runs.
- publish: `learner_jax/publish.py` of a full-depth random model (bf16 on the wire) to a
  `file` WeightStore in a temporary directory, twice (the first includes opening the
  store); `publish_s_*` is the second.

`--reduced` shrinks every model (1/16 of the width, 4 heads, 2 kv heads, head dim 32,
vocabulary 512, one layer, measured at its own depth) and every length (64 and 128
tokens), and publishes the small preset only, so its numbers check the wiring only: they
describe no real model. On CPU, bf16 compute runs too, but `memory_stats` is None.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from bench import attention_accuracy, rl_step, step_cost
from bridge.model import presets
from bridge.model.config import ModelConfig
from learner_jax.model import attention, model, sharding
from learner_jax.training import train_step

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "JSON file for the results.")
flags.DEFINE_bool("reduced", False, "Tiny shapes and lengths: the wiring, on any backend.")
flags.DEFINE_list("models", ["0p6b", "1p7b"], "Presets whose MFU is measured.")
flags.DEFINE_list("mfu_layers", None, "Layer counts the step runs at [4,8; reduced 1].")
flags.DEFINE_list("memory_layers", None, "Layer counts of the memory sweep [4,8; reduced 1].")
flags.DEFINE_integer("full_layers", None, "Depth extrapolated to [28; reduced 1].")
flags.DEFINE_integer("batch", None, "Rows per MFU step [4; reduced 2].")
flags.DEFINE_integer("seq_len", None, "Tokens per MFU row [2048; reduced 64].")
flags.DEFINE_integer("steps", 3, "Timed steps per point (median) after the compile.")
flags.DEFINE_list("memory_seq_lens", None, "Memory sweep lengths [1k..8k; reduced 64,128].")
flags.DEFINE_list("attention_seq_lens", None, "Attention lengths [1k..8k; reduced 128].")
flags.DEFINE_integer("numpy_max_len", 1024, "Longest T with a float64 numpy reference.")
flags.DEFINE_integer("matmul_n", None, "Matmul size for the measured peak [8192; reduced 256].")
flags.DEFINE_string("attention", "auto", "The step's attention (cuDNN on GPU); see first_step.")
flags.DEFINE_integer("logprob_chunk", 1024, "model.logprob_chunk of the step (0 = full logits).")
flags.DEFINE_list("publish_models", None, "Presets published [0p6b,1p7b; reduced 0p6b].")
flags.DEFINE_string("compile_cache", None, "JAX's persistent compilation cache directory.")
flags.DEFINE_integer("worker_memory_layers", 0, "Internal: run the memory sweep at this depth.")

FULL = {
    "mfu_layers": ["4", "8"],
    "memory_layers": ["4", "8"],
    "full_layers": 28,
    "batch": 4,
    "seq_len": 2048,
    "memory_seq_lens": ["1024", "2048", "4096", "8192"],
    "attention_seq_lens": ["1024", "2048", "4096", "8192"],
    "matmul_n": 8192,
    "publish_models": ["0p6b", "1p7b"],
}
# Every train-step compile costs seconds of CPU even at these shapes: one depth, no
# extrapolation (fit_layers has its own test), two memory points, one attention length.
REDUCED = {
    "mfu_layers": ["1"],
    "memory_layers": ["1"],
    "full_layers": 1,
    "batch": 2,
    "seq_len": 64,
    "memory_seq_lens": ["64", "128"],
    "attention_seq_lens": ["128"],
    "matmul_n": 256,
    "publish_models": ["0p6b"],
}
PRESETS = {"0p6b": presets.qwen3_0p6b, "1p7b": presets.qwen3_1p7b}
GIB = 2**30


def opt(name: str):
    """A flag's value, or this form's default where it was not given."""
    value = getattr(FLAGS, name)
    if value is not None:
        return value
    return (REDUCED if FLAGS.reduced else FULL)[name]


def ints(name: str) -> list[int]:
    return sorted(int(x) for x in opt(name))


def model_config(name: str, layers: int, reduced: bool) -> ModelConfig:
    """The preset at `layers` depth; `reduced`: 1/16 of its width, small heads and vocab."""
    cfg = PRESETS[name](layers)
    if not reduced:
        return cfg
    return dataclasses.replace(
        cfg,
        vocab_size=512,
        hidden_size=cfg.hidden_size // 16,
        intermediate_size=cfg.intermediate_size // 16,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
    )


def single_mesh():
    return sharding.make_mesh({"data": 1}, jax.devices()[:1])


def compile_step(step, state, batch, mesh):
    """The step compiled ahead of time (one compile), with its compile time and XLA plan."""
    t0 = time.perf_counter()
    with sharding.use_mesh(mesh):
        compiled = step.jitted.lower(state, batch).compile()
    return compiled, time.perf_counter() - t0, step_cost.compiled_bytes(compiled)


def first_step(cfg: ModelConfig, mesh, b: int, t: int, state=None) -> dict:
    """One RL step on b x t random tokens, compiled ahead of time and run once (the warm-up).

    `--attention` first; if that fails (a fused kernel this runtime rejects), "blockwise",
    with the failure kept under `attention_error`: a step that runs beats no number. The
    dict holds the state after the step (`state` is reused unless a failed try consumed
    it), the compiled step, its batch, compile_s, XLA's plan in bytes, and the attention
    that ran (resolved: "dot_product" is cuDNN's on a GPU).
    """
    errors = []
    for impl in dict.fromkeys((FLAGS.attention, "blockwise")):
        try:
            options = model.ModelOptions(attention=impl, logprob_chunk=FLAGS.logprob_chunk)
            if state is None or any(x.is_deleted() for x in jax.tree.leaves(state)):
                state, step = rl_step.build(cfg, mesh, "bfloat16", options)
            else:
                step = rl_step.jit_step(cfg, mesh, "bfloat16", options)
            rows = rl_step.random_batch(cfg, b, t, np.random.default_rng(0))
            batch = train_step.put_batch(rows, mesh)
            compiled, compile_s, plan = compile_step(step, state, batch, mesh)
            state, m = compiled(state, batch)
            jax.block_until_ready(m)
        except Exception as e:  # kept in the row, then the fallback runs
            errors.append(f"{impl}: {type(e).__name__}: {str(e)[:300]}")
            continue
        return {"state": state, "compiled": compiled, "batch": batch, "compile_s": compile_s,
                "plan": plan, "loss": float(m["loss"]),
                "attention": attention.resolve(impl, jnp.bfloat16, cfg.head_dim, t),
                "attention_error": "; ".join(errors) or None}  # fmt: skip
    raise RuntimeError("; ".join(errors))


def fit_layers(points: dict[int, float], layers: int) -> tuple[float, bool]:
    """(value at `layers`, extrapolated?): measured if present, else the least-squares line
    through (layer count, value)."""
    if layers in points:
        return points[layers], False
    if len(points) < 2:
        raise ValueError(f"need {layers} layers or two layer counts to extrapolate, got {points}")
    slope, intercept = np.polyfit(list(points), list(points.values()), 1)
    return float(intercept + slope * layers), True


def mfu_rows(name: str, peak_measured: float, peak_spec: float | None) -> list[dict]:
    mesh = single_mesh()
    b, t = opt("batch"), opt("seq_len")
    rows, times = [], {}
    for layers in ints("mfu_layers"):
        run = first_step(model_config(name, layers, FLAGS.reduced), mesh, b, t)
        state, compiled, batch = run.pop("state"), run.pop("compiled"), run.pop("batch")
        ts = []
        for _ in range(FLAGS.steps):
            t0 = time.perf_counter()
            state, m = compiled(state, batch)
            jax.block_until_ready(m)
            ts.append(time.perf_counter() - t0)
        times[layers] = statistics.median(ts)
        plan = run.pop("plan")
        rows.append({"layers": layers, **run, "step_s": times[layers],
                     "xla_plan_gb": None if plan is None else plan / GIB,
                     "extrapolated": False})  # fmt: skip
        del state, compiled
    full = opt("full_layers")
    step_s, extrapolated = fit_layers(times, full)
    if extrapolated:
        rows.append({"layers": full, "step_s": step_s, "extrapolated": True})
    for row in rows:
        flops = step_cost.model_flops_per_step(
            model_config(name, row["layers"], FLAGS.reduced), b, t
        )
        row.update(
            kind="mfu",
            model=name,
            batch=b,
            seq_len=t,
            model_tflops_per_step=flops / 1e12,
            tokens_per_s=b * t / row["step_s"],
            mfu=flops / row["step_s"] / peak_measured,
            mfu_vs_spec=None if peak_spec is None else flops / row["step_s"] / peak_spec,
        )
    return rows


def memory_worker(layers: int) -> list[dict]:
    """The memory sweep at one depth, in this (fresh) process, T ascending."""
    mesh = single_mesh()
    cfg = model_config("0p6b", layers, FLAGS.reduced)
    rows, state = [], None
    for t in ints("memory_seq_lens"):
        try:
            run = first_step(cfg, mesh, 1, t, state)
        except Exception as e:  # out of memory, say: the shorter lengths still count
            rows.append({"kind": "memory", "model": "0p6b", "layers": layers, "seq_len": t,
                         "peak_device_gb": None, "xla_plan_gb": None, "extrapolated": False,
                         "peak_source": f"failed: {type(e).__name__}: {str(e)[:300]}"})  # fmt: skip
            break
        state = run["state"]
        peak, source = step_cost.device_peak_bytes()
        rows.append({"kind": "memory", "model": "0p6b", "layers": layers, "seq_len": t,
                     "peak_device_gb": None if peak is None else peak / GIB,
                     "peak_source": source,
                     "xla_plan_gb": None if run["plan"] is None else run["plan"] / GIB,
                     "attention": run["attention"], "attention_error": run["attention_error"],
                     "extrapolated": False})  # fmt: skip
        del run
    return rows


def memory_rows() -> list[dict]:
    """One subprocess per depth, then the per-T fit to `full_layers`."""
    rows = []
    for layers in ints("memory_layers"):
        lens = ",".join(opt("memory_seq_lens"))
        cache = [f"--compile_cache={FLAGS.compile_cache}"] if FLAGS.compile_cache else []
        cmd = [sys.executable, "-m", "bench.gpu_learner", f"--worker_memory_layers={layers}",
               f"--reduced={FLAGS.reduced}", f"--memory_seq_lens={lens}",
               f"--logprob_chunk={FLAGS.logprob_chunk}", f"--attention={FLAGS.attention}",
               *cache]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:  # the other depths' rows still count
            why = f"exit {proc.returncode}: {proc.stderr[-1500:]}"
            rows.append({"kind": "error", "phase": f"memory L={layers}", "error": why})
            continue
        rows.extend(json.loads(lines[-1][len("RESULT ") :]))
    mem = [r for r in rows if r["kind"] == "memory"]
    return rows + memory_fit(mem, opt("full_layers"))


def memory_fit(rows: list[dict], full: int) -> list[dict]:
    """Per T not measured at `full` layers, a row extrapolated there by `fit_layers` (None
    where any depth had no reading)."""
    out = []
    for t in sorted({r["seq_len"] for r in rows}):
        at_t = [r for r in rows if r["seq_len"] == t]
        if any(r["layers"] == full for r in at_t) or len(at_t) < 2:
            continue
        row = {"kind": "memory", "model": "0p6b", "layers": full, "seq_len": t,
               "peak_source": at_t[0]["peak_source"], "extrapolated": True}  # fmt: skip
        for key in ("peak_device_gb", "xla_plan_gb"):
            pts = {r["layers"]: r[key] for r in at_t}
            row[key] = None if None in pts.values() else fit_layers(pts, full)[0]
        out.append(row)
    return out


def publish_rows(name: str) -> list[dict]:
    # Imported here: the store needs blake3 and pydantic, which an accelerator machine may
    # lack (see the module docstring); every other phase runs without them.
    from bridge.store.weight_store import WeightStore
    from learner_jax import publish

    cfg = model_config(name, opt("full_layers"), FLAGS.reduced)
    params = model.init_params(cfg, jax.random.key(0))
    jax.block_until_ready(params)
    nbytes = 2 * sum(x.size for x in jax.tree.leaves(params))  # bf16 on the wire
    rows = []
    with tempfile.TemporaryDirectory() as root:
        store = WeightStore(os.path.join(root, "store"))
        for version in (1, 2):
            t0 = time.perf_counter()
            publish.publish_params(store, version, version, cfg, params, "bfloat16")
            s = time.perf_counter() - t0
            rows.append({"kind": "publish", "model": name, "layers": cfg.num_layers,
                         "version": version, "publish_s": s, "gb": nbytes / GIB,
                         "gb_per_s": nbytes / GIB / s})  # fmt: skip
    return rows


def headline(rows: list[dict], device: str, peak_measured, peak_spec) -> dict:
    """The headline keys from the rows so far; a key whose rows are missing (a failed or
    unfinished phase) is None, and `notes` says why for every None."""
    full, notes = opt("full_layers"), []
    h = {"device": device, "reduced": FLAGS.reduced,
         "matmul_tflops": None if peak_measured is None else peak_measured / 1e12,
         "spec_tflops": None if peak_spec is None else peak_spec / 1e12}  # fmt: skip
    for name in FLAGS.models:
        mfu = [r for r in rows if r["kind"] == "mfu" and r["model"] == name
               and r["layers"] == full]  # fmt: skip
        h[f"mfu_{name}"] = mfu[0]["mfu"] if mfu else None
        h[f"mfu_{name}_vs_spec"] = mfu[0]["mfu_vs_spec"] if mfu else None
        if not mfu:
            notes.append(f"mfu_{name}: not measured (see the error rows)")
        elif mfu[0]["extrapolated"]:
            notes.append(f"mfu_{name}: step time extrapolated to {full} layers from "
                         f"{ints('mfu_layers')}")  # fmt: skip
    if peak_spec is None:
        notes.append(f"mfu_*_vs_spec: no spec peak for {device}")
    for r in rows:
        if r.get("attention_error"):
            notes.append(f"{r['kind']} {r.get('model')} L={r['layers']}: ran {r['attention']} "
                         f"attention after {r['attention_error'][:200]}")  # fmt: skip
    att = [r for r in rows if r["kind"] == "attention"]

    def worst(arm, key="max_rel_err"):
        vals = [r[key] for r in att if r["arm"] == arm and r.get(key) is not None]
        return max(vals) if vals else None

    h["cudnn_attention_max_rel_err"] = worst("cudnn_bf16")
    h["xla_bf16_attention_max_rel_err"] = worst("xla_bf16")
    # fp32 at the default matmul precision (TF32 where the backend allows), and the
    # reference (highest precision) every arm is measured against
    h["xla_fp32_vs_float64_max_rel_err"] = worst("xla_fp32", "max_rel_err_vs_float64")
    h["reference_vs_float64_max_rel_err"] = worst("reference_fp32", "max_rel_err_vs_float64")
    if h["cudnn_attention_max_rel_err"] is None:
        why = [r.get("skipped") or r.get("error") for r in att if r["arm"] == "cudnn_bf16"]
        notes.append(f"cudnn_attention_max_rel_err: {why[0] if why else 'not run'}")
    mem = [r for r in rows if r["kind"] == "memory" and r["layers"] == full]
    at_8k = [r for r in mem if r["seq_len"] == 8192]
    h["peak_gb_8k_0p6b"] = at_8k[0]["peak_device_gb"] if at_8k else None
    h["xla_plan_gb_8k_0p6b"] = at_8k[0]["xla_plan_gb"] if at_8k else None
    nulls = [r for r in mem if r["peak_device_gb"] is None]
    if nulls:
        notes.append(f"peak_gb_*: null where {nulls[0]['peak_source']}")
    if not mem:
        notes.append("peak_gb_8k_0p6b: the memory sweep did not run (see the error rows)")
    elif not at_8k:
        notes.append(f"peak_gb_8k_0p6b: null, no T=8192 reading at {full} layers "
                     f"(lengths {ints('memory_seq_lens')}; see the rows)")  # fmt: skip
    elif at_8k[0]["extrapolated"] and at_8k[0]["peak_device_gb"] is not None:
        notes.append(f"peak_gb_8k_0p6b: extrapolated to {full} layers from "
                     f"{ints('memory_layers')}")  # fmt: skip
    for name in opt("publish_models"):
        pub = [r["publish_s"] for r in rows if r["kind"] == "publish" and r["model"] == name]
        h[f"publish_s_{name}"] = pub[-1] if pub else None
    if FLAGS.reduced:
        notes.append("reduced: tiny shapes; the numbers check the wiring, not a real model")
    h["notes"] = notes
    return h


def print_table(rows: list[dict]) -> None:
    for kind in dict.fromkeys(r["kind"] for r in rows):
        of_kind = [r for r in rows if r["kind"] == kind]
        cols = [c for c in dict.fromkeys(k for r in of_kind for k in r) if c != "kind"]
        print(f"\n[{kind}]")
        print("  ".join(f"{c:>14}" for c in cols))
        for r in of_kind:
            cells = [r.get(c) for c in cols]
            print("  ".join(f"{v:>14.4g}" if isinstance(v, float) else f"{str(v)[:14]:>14}"
                            for v in cells))  # fmt: skip


def main(argv):
    del argv
    if FLAGS.compile_cache:
        jax.config.update("jax_compilation_cache_dir", FLAGS.compile_cache)
    if FLAGS.worker_memory_layers:
        print("RESULT " + json.dumps(memory_worker(FLAGS.worker_memory_layers)))
        return
    if not FLAGS.out:
        raise app.UsageError("--out is required")
    rows, wall, peaks = [], {}, {"measured": None, "spec": None}

    def matmul():
        peaks["measured"] = step_cost.measured_matmul_flops(jnp.bfloat16, opt("matmul_n"))
        peaks["spec"], source = step_cost.spec_peak_flops(jax.devices()[:1])
        return [{"kind": "matmul", "n": opt("matmul_n"), "tflops": peaks["measured"] / 1e12,
                 "spec_tflops": None if peaks["spec"] is None else peaks["spec"] / 1e12,
                 "spec_source": source}]  # fmt: skip

    def attention_phase():
        shape = model_config("0p6b", 1, FLAGS.reduced)
        heads = (shape.num_heads, shape.num_kv_heads, shape.head_dim)
        return [r for t in ints("attention_seq_lens")
                for r in attention_accuracy.compare(t, *heads, FLAGS.numpy_max_len)]  # fmt: skip

    phases = [
        # First: its subprocesses need the device to themselves (nothing has touched it yet).
        ("memory", memory_rows),
        ("matmul", matmul),
        *[(f"mfu_{m}", lambda m=m: mfu_rows(m, peaks["measured"], peaks["spec"]))
          for m in FLAGS.models],
        ("attention", attention_phase),
        *[(f"publish_{m}", lambda m=m: publish_rows(m)) for m in opt("publish_models")],
    ]  # fmt: skip
    device = None
    for name, phase in phases:
        t0 = time.perf_counter()
        try:
            rows.extend(phase())
        except Exception as e:  # one failed phase must not cost the others' numbers
            why = f"{type(e).__name__}: {e}"
            if name.startswith("mfu") and peaks["measured"] is None:
                why = "no measured matmul peak (the matmul phase failed)"
            rows.append({"kind": "error", "phase": name, "error": why})
            print(f"phase {name} failed: {why}", file=sys.stderr, flush=True)
        wall[name] = time.perf_counter() - t0
        device = device or f"{jax.devices()[0].device_kind} ({jax.default_backend()})"
        print(f"phase {name}: {wall[name]:.1f} s", flush=True)
        result = {"headline": headline(rows, device, peaks["measured"], peaks["spec"]),
                  "rows": rows, "wall_s": wall, "logprob_chunk": FLAGS.logprob_chunk,
                  "complete": name == phases[-1][0]}  # fmt: skip
        with open(FLAGS.out, "w") as f:  # after every phase: a killed run keeps what it had
            json.dump(result, f, indent=2)
    print_table(rows)
    print(f"\nwall seconds per phase: {json.dumps({k: round(v, 1) for k, v in wall.items()})}")
    print("headline: " + json.dumps(result["headline"], indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    app.run(main)
