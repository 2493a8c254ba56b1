"""Peak host memory of one RL train step vs sequence length, per attention implementation
and per log-prob path (chunked over the vocabulary, or the full [T, V] logits).

A Qwen3-0.6B-shaped policy (`bridge/model/presets.py`) with random weights runs one full
RL train step (forward + backward of the GRPO loss, entropy and mismatch metrics, AdamW
update) on one row of T tokens. Each (implementation, T) point runs in a fresh
subprocess that reports its own peak RSS (VmHWM), so points do not share allocator state.

    python -m bench.memory --out=/tmp/bench_memory.json \
        [--num_layers=2 --seq_lens=1024,2048,4096,8192 --impls=auto --logprob_chunks=1024,0]

Each arm is (attention implementation, `model.logprob_chunk`); an arm with chunk 0 is named
`IMPL_full` (the full-logits baseline). Headline: `exponent_auto` (the slope below for the
chunked "auto" arm), `peak_gb_8k_auto` (its measured peak at T = 8192) and `measured_8k`
(true only if that point ran rather than being predicted).

Fewer layers than the real 28 by default, for speed: only the attention part grows as
T^2, and it grows per layer, so the exponent does not depend on the layer count.
"Attention-attributable" memory is the peak minus the peak at `--floor_len` (params,
optimizer state, runtime), and its exponent is the least-squares log-log slope over the
measured T. It still includes the T-linear activations, so an implementation without T^2
memory fits a slope near 1. With the full logits ([T, V] fp32, 0.6 MB per token per copy at
V = 151936) the T-linear part dominates and 8k does not fit 24 GB; the chunked path holds
O(chunk x V) instead (learner_jax/model/logprobs.py).
A point is skipped, and says so, when the implementation's last two points, extrapolated
with their own exponent (clamped to [1, 2], +15%), would exceed --max_gb or the machine's
free memory (no OOM of a shared machine); the skipped peak is reported as that prediction.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from bench import rl_step, step_cost
from bridge.model.presets import qwen3_0p6b
from learner_jax.model import attention, model, sharding
from learner_jax.training import train_step

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "JSON file for the results.")
flags.DEFINE_integer("num_layers", 2, "Decoder layers (28 = Qwen3-0.6B; 2 for speed).")
flags.DEFINE_list("seq_lens", ["1024", "2048", "4096", "8192"], "Tokens per row.")
flags.DEFINE_integer("floor_len", 128, "Short T whose peak is the T-independent floor.")
flags.DEFINE_list("impls", ["auto"], "Attention implementations (model.ModelOptions).")
flags.DEFINE_list("logprob_chunks", ["1024", "0"], "model.logprob_chunk per arm (0 = full).")
flags.DEFINE_integer("vocab_size", 0, "Override the vocab (0 = Qwen3's 151936); see above.")
flags.DEFINE_string("remat", "none", "model.ModelOptions.remat for every point.")
flags.DEFINE_string("dtype", "float32", "Compute dtype.")
flags.DEFINE_float("max_gb", 20.0, "Skip points predicted to need more than this.")
flags.DEFINE_float("budget_gb", 24.0, "The memory the 'fits' column is checked against.")
flags.DEFINE_integer("worker_seq_len", 0, "Internal: measure one point in this process.")
flags.DEFINE_string("worker_impl", "", "Internal: the point's implementation.")
flags.DEFINE_integer("worker_chunk", 0, "Internal: the point's logprob_chunk.")


def measure(impl: str, chunk: int, seq_len: int) -> dict:
    """One train step in this process; returns its peak RSS and the resolved attention."""
    cfg = qwen3_0p6b(FLAGS.num_layers)
    if FLAGS.vocab_size:
        cfg = dataclasses.replace(cfg, vocab_size=FLAGS.vocab_size)
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    options = model.ModelOptions(attention=impl, remat=FLAGS.remat, logprob_chunk=chunk)
    state, step = rl_step.build(cfg, mesh, FLAGS.dtype, options)
    batch = rl_step.random_batch(cfg, 1, seq_len, np.random.default_rng(0))
    state, metrics = step(state, train_step.put_batch(batch, mesh))
    loss = float(metrics["loss"])
    resolved = attention.resolve(impl, jnp.dtype(FLAGS.dtype), cfg.head_dim, seq_len)
    return {"peak_gb": step_cost.host_peak_gb(), "loss": loss, "resolved": resolved}


def run_point(impl: str, chunk: int, seq_len: int) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "bench.memory",
        f"--worker_seq_len={seq_len}",
        f"--worker_impl={impl}",
        f"--worker_chunk={chunk}",
        f"--num_layers={FLAGS.num_layers}",
        f"--vocab_size={FLAGS.vocab_size}",
        f"--remat={FLAGS.remat}",
        f"--dtype={FLAGS.dtype}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr or proc.stdout)[-400:]}
    return json.loads(lines[-1][len("RESULT ") :])


def available_gb() -> float:
    with open("/proc/meminfo") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    return kb / 2**20


def slope(lens, deltas) -> float:
    pts = [(math.log(t), math.log(d)) for t, d in zip(lens, deltas, strict=True) if d > 0]
    if len(pts) < 2:
        return math.nan
    x, y = np.array(pts).T
    return float(np.polyfit(x, y, 1)[0])


def predict_over_floor(measured, t) -> float:
    """Memory over the floor at T = t, extrapolated from the last two measured points with
    their local exponent clamped to [1, 2] (T^2 from one point), plus 15% margin."""
    if not measured:
        return 0.0
    t1, d1 = measured[-1]
    exponent = 2.0
    if len(measured) >= 2 and measured[-2][1] > 0 and d1 > 0:
        t0, d0 = measured[-2]
        exponent = min(2.0, max(1.0, math.log(d1 / d0) / math.log(t1 / t0)))
    return 1.15 * max(d1, 0.0) * (t / t1) ** exponent


def main(argv):
    del argv
    if FLAGS.worker_seq_len:
        point = measure(FLAGS.worker_impl, FLAGS.worker_chunk, FLAGS.worker_seq_len)
        print("RESULT " + json.dumps(point))
        return
    if not FLAGS.out:
        raise app.UsageError("--out is required")
    lens = sorted(int(t) for t in FLAGS.seq_lens)
    rows, summary = [], {}
    arms = [(i, int(c)) for c in FLAGS.logprob_chunks for i in FLAGS.impls]
    for impl, chunk in arms:
        arm = impl if chunk else f"{impl}_full"
        floor = run_point(impl, chunk, FLAGS.floor_len)
        if "error" in floor:
            raise RuntimeError(f"{arm} at T={FLAGS.floor_len}: {floor['error']}")
        measured = []
        for t in lens:
            predicted = floor["peak_gb"] + predict_over_floor(measured, t)
            limit = min(FLAGS.max_gb, available_gb() - 1.5)
            row = {"impl": arm, "logprob_chunk": chunk, "seq_len": t, "floor_gb": floor["peak_gb"]}
            if predicted > limit:
                row.update(skipped=f"predicted {predicted:.1f} GB > limit {limit:.1f} GB")
                row["peak_gb"] = predicted
            else:
                row.update(run_point(impl, chunk, t))
            if "error" not in row and "skipped" not in row:
                measured.append((t, row["peak_gb"] - floor["peak_gb"]))
            print(json.dumps(row), flush=True)
            rows.append(row)
        summary[arm] = {
            "resolved": floor["resolved"],
            "attention_exponent": slope(*zip(*measured, strict=True)) if measured else math.nan,
            "last_pair_exponent": slope(*zip(*measured[-2:], strict=True))
            if measured
            else math.nan,
            "fits_budget_at_max_len": bool(rows[-1].get("peak_gb", math.inf) < FLAGS.budget_gb),
            "max_len_measured": "skipped" not in rows[-1] and "error" not in rows[-1],
            "peak_gb_max_len": rows[-1].get("peak_gb", math.nan),
        }
    print(f"\n{'arm':<10}{'resolved':<12}{'T':>6}{'peak GB':>9}{'over floor':>11}  note")
    for r in rows:
        res = summary[r["impl"]]["resolved"]
        peak = r.get("peak_gb", math.nan)
        note = r.get("skipped") or r.get("error", "")[:60]
        note = note and (f"(skipped) {note}" if "skipped" in r else note)
        print(
            f"{r['impl']:<10}{res:<12}{r['seq_len']:>6}{peak:>9.2f}"
            f"{peak - r['floor_gb']:>11.2f}  {note}"
        )
    for impl, s in summary.items():
        print(
            f"{impl} ({s['resolved']}): memory-over-floor ~ T^{s['attention_exponent']:.2f} "
            f"(last two points T^{s['last_pair_exponent']:.2f}); "
            f"T={lens[-1]} fits {FLAGS.budget_gb:g} GB: {s['fits_budget_at_max_len']}"
            + ("" if s["max_len_measured"] else " (predicted, not run)")
        )
    auto = summary.get("auto", {})
    headline = {
        "exponent_auto": auto.get("attention_exponent", math.nan),
        "peak_gb_8k_auto": auto.get("peak_gb_max_len", math.nan) if lens[-1] == 8192 else None,
        "measured_8k": bool(lens[-1] == 8192 and auto.get("max_len_measured", False)),
    }
    result = {
        "headline": headline,
        "model": "Qwen3-0.6B shapes",
        "num_layers": FLAGS.num_layers,
        "vocab_size": FLAGS.vocab_size or 151936,
        "batch": 1,
        "dtype": FLAGS.dtype,
        "remat": FLAGS.remat,
        "floor_len": FLAGS.floor_len,
        "rows": rows,
        "summary": summary,
    }
    with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=2)
    print("headline: " + json.dumps(headline))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    app.run(main)
