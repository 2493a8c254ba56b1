"""Delta versions vs full versions: bytes, publish time, worker apply time, bit-exactness.

A Qwen3-0.6B-shaped model (vocab 151936, hidden 1024, mlp 3072, 16 heads, 8 kv heads,
head_dim 128, tied; `--num_layers`, 28 = the real model) with random weights in an HF
directory is loaded by the JAX learner (fp32 master weights, Adam) and trained for
`--steps` RL updates of the real loss (GRPO on random token batches) at each learning
rate. After every update the params are published twice, side by side, in bf16:
  full   WeightStore.publish from the sharded params (today's path)
  delta  DeltaPublisher (bridge/weights/): patches on the previous version
Per version: changed fraction, bytes stored (delta / full), publish seconds, and what zstd
bought (the patches' size without it). Then a worker applies each version in turn:
  full swap  weight_swap.load_version of the full version (read + verify + reload all)
  delta      load_version of the delta version: rebuild from the version served, verify
             every tensor, reload only the changed vLLM modules
(`--noswap`: no vLLM engine, read_all vs reconstruct only). bit_exact: every rebuilt tensor
equals the full version's bytes (and passed the manifest's full-tensor checksum).

    python -m bench.delta --out=/tmp/bench_delta.json [--num_layers=28] [--steps=10]

On the shared 2-core CI machine it runs with --num_layers=4 (real vocab/hidden/mlp shapes,
fewer layers: the learner's fp32 weights + Adam of all 28 layers do not fit beside others).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
from absl import app, flags

from bridge.model import tiny_model
from bridge.model.presets import qwen3_0p6b
from bridge.store.weight_store import WeightStore
from bridge.weights.delta_publisher import DeltaPublisher

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "JSON file for the results.", required=True)
flags.DEFINE_integer("num_layers", 28, "Decoder layers (28 = Qwen3-0.6B).")
flags.DEFINE_integer("steps", 10, "Optimizer steps (versions) per learning rate.")
flags.DEFINE_list("lrs", ["1e-6", "1e-5"], "Adam learning rates.")
flags.DEFINE_integer("rows", 8, "Sequences per RL batch.")
flags.DEFINE_integer("seq_len", 64, "Tokens per sequence.")
flags.DEFINE_float("max_density", 0.5, "bridge.delta.max_density")
flags.DEFINE_bool("swap", True, "Apply the versions in a vLLM engine (bf16).")
flags.DEFINE_string("scratch_dir", None, "Scratch directory (default: tmp).")


def rl_items(n, rows, length, vocab, seed=0):
    """Random RL batches with random advantages: every step moves the weights."""
    from learner_jax import train_step

    rng = np.random.default_rng(seed)
    for i in range(n):
        tokens = rng.integers(3, vocab, (rows, length + 1))
        mask = np.zeros_like(tokens)
        mask[:, 8:] = 1
        batch = train_step.make_batch(
            tokens,
            mask,
            behavior_logp=-12.0 + 0.1 * rng.standard_normal((rows, length)),
            advantages=rng.standard_normal(rows),
            on_policy=np.ones(rows),
        )
        yield batch, {"policy_version": i, "reward/mean": 0.0}, {"next_prompt": rows * (i + 1)}


def learner_config(hf_dir: str, lr: float, steps: int, rows: int, seq_len: int):
    from learner_jax.config_file import load_config

    c = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "tiny_arith.py"))
    c.model.hf_dir, c.model.param_dtype, c.model.dtype = hf_dir, "float32", "float32"
    c.optimizer.learning_rate, c.optimizer.warmup_steps = lr, 0
    c.optimizer.end_lr_fraction = 1.0  # constant lr: every step at the named rate
    c.total_steps, c.sft.steps, c.local_workers = steps, 0, 0
    c.batch.groups_per_step, c.batch.samples_per_group = rows // 2, 2
    c.batch.micro_batch_size = rows
    c.batch.max_prompt_len, c.batch.max_answer_len = 8, seq_len - 8
    c.checkpoint.interval = 10**6
    c.checkpoint.async_save = False
    return c


class PublishBoth:
    """After-step hook: publish the learner's params full and as a delta, timed."""

    def __init__(self, full: WeightStore, delta: WeightStore, max_density: float):
        self.full, self.delta_store = full, delta
        self.delta = DeltaPublisher(delta, anchor_every=10**6, max_density=max_density)
        self.rows = []

    def after_step(self, learner, metrics=None):
        from learner_jax import publish

        cfg, params, v = learner.model_cfg, learner.state.params, learner.step
        t0 = time.perf_counter()
        self.full.publish(v, v, publish.hf_sources(cfg, params), cfg.to_hf_dict(), "bfloat16")
        t1 = time.perf_counter()
        m = self.delta.publish(v, v, publish.hf_sources(cfg, params), cfg.to_hf_dict())
        t2 = time.perf_counter()
        row = {"version": v, "full_publish_s": t1 - t0, "delta_publish_s": t2 - t1}
        if m.delta is not None:
            row.update(
                changed_fraction=m.delta.density,
                bytes=m.delta.nbytes,
                full_bytes=m.total_bytes,
                bytes_ratio=m.delta.nbytes / m.total_bytes,
                bytes_without_zstd=self.delta.last.uncompressed_bytes,
                dense_tensors=sum(p.kind == "dense" for p in m.delta.tensors.values()),
            )
        self.rows.append(row)
        print(
            f"  v{v}: publish full {row['full_publish_s']:.2f}s delta {row['delta_publish_s']:.2f}s"
            + (
                f", changed {100 * m.delta.density:.2f}%, bytes {100 * row['bytes_ratio']:.2f}%"
                f" of full"
                if m.delta
                else " (anchor)"
            )  # fmt: skip
        )


def train_and_publish(hf_dir, scratch, lr) -> tuple[list[dict], str, str]:
    from learner_jax.learner import Learner

    tag = f"lr{lr:g}"
    full = WeightStore(os.path.join(scratch, f"full_{tag}"))
    delta = WeightStore(os.path.join(scratch, f"delta_{tag}"))
    config = learner_config(hf_dir, lr, FLAGS.steps, FLAGS.rows, FLAGS.seq_len)
    learner = Learner(config, os.path.join(scratch, f"wd_{tag}"))
    learner.save = lambda force=False: False  # checkpoints are not what is measured here
    hook = PublishBoth(full, delta, FLAGS.max_density)
    try:
        learner.start_rl()  # the RL optimizer (Adam), as the training binary's RL phase
        hook.after_step(learner)  # version 0: the initial weights (an anchor)
        vocab = learner.model_cfg.vocab_size
        for batch, _, _ in rl_items(FLAGS.steps, FLAGS.rows, FLAGS.seq_len, vocab):
            metrics = learner.train_step(batch)  # the real loss (GRPO), one Adam update
            print(f"  step {learner.step}: loss {metrics.get('loss', float('nan')):.4f}")
            hook.after_step(learner)
    finally:
        learner.close()
    return hook.rows, full.spec["path"], delta.spec["path"]


def apply_versions(engine, full_path, delta_path, versions) -> list[dict]:
    """Load every version in turn on a worker, by the full and by the delta route."""
    from rollout_gpu import weight_swap

    full, delta = WeightStore(full_path), WeightStore(delta_path)
    cur_full, cur_delta = weight_swap.EngineVersion(), weight_swap.EngineVersion()
    rows = []
    for v in versions:
        t0 = time.perf_counter()
        if engine is not None:
            weight_swap.load_version(engine, full, v, cur_full)
        else:
            cur_full.version, cur_full.tensors = v, full.read_all(v)
        t1 = time.perf_counter()
        if engine is not None:
            weight_swap.load_version(engine, delta, v, cur_delta)
        else:
            from bridge.weights.delta_reconstruct import reconstruct

            have = None if cur_delta.tensors is None else (cur_delta.version, cur_delta.tensors)
            cur_delta.version, cur_delta.tensors = v, reconstruct(delta, v, have=have).tensors
        t2 = time.perf_counter()
        exact = all(
            cur_delta.tensors[n].tobytes() == cur_full.tensors[n].tobytes()
            for n in cur_full.tensors
        )
        rows.append(
            {"version": v, "full_swap_s": t1 - t0, "delta_apply_s": t2 - t1, "bit_exact": exact}
        )
        print(f"  apply v{v}: full {t1 - t0:.2f}s delta {t2 - t1:.2f}s bit_exact={exact}")
    return rows


def main(argv):
    del argv
    cfg = qwen3_0p6b(FLAGS.num_layers)
    scratch = tempfile.mkdtemp(prefix="bench_delta_", dir=FLAGS.scratch_dir)
    results, t_start = {}, time.perf_counter()
    try:
        hf_dir = tiny_model.make_tiny_model(os.path.join(scratch, "hf"), cfg, seed=0)
        stores = {}
        for lr_text in FLAGS.lrs:
            lr = float(lr_text)
            print(f"lr {lr:g}: {FLAGS.steps} Adam steps, {cfg.num_layers} layers")
            rows, full_path, delta_path = train_and_publish(hf_dir, scratch, lr)
            results[lr_text] = {"publish": rows}
            stores[lr_text] = (full_path, delta_path)
            with open(FLAGS.out + ".partial", "w") as f:  # a later OOM keeps what is done
                json.dump(results, f, indent=1)
        engine = None
        if FLAGS.swap:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            from rollout_gpu.vllm_engine import VllmEngine

            engine = VllmEngine.start(hf_dir, dtype="bfloat16", max_model_len=256, max_num_seqs=8)
        for lr_text, (full_path, delta_path) in stores.items():
            print(f"lr {lr_text}: applying versions 0..{FLAGS.steps}")
            results[lr_text]["apply"] = apply_versions(
                engine, full_path, delta_path, range(FLAGS.steps + 1)
            )
            with open(FLAGS.out + ".partial", "w") as f:
                json.dump(results, f, indent=1)
        del engine
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report(cfg, results, time.perf_counter() - t_start)


def _med(rows, key):
    vals = [r[key] for r in rows if key in r]
    return statistics.median(vals) if vals else float("nan")


def report(cfg, results, wall_s):
    headline, table = {}, []
    print(
        f"\n{'lr':>6} {'changed%':>9} {'bytes%':>8} {'no-zstd%':>9} {'pub d/f':>8} "
        f"{'apply d/f':>10}"
    )
    for lr_text, res in results.items():
        pub = [r for r in res["publish"] if "bytes" in r]
        apply = res["apply"][1:]  # version 0 is a full load on both routes
        line = {
            "lr": lr_text,
            "changed_fraction": _med(pub, "changed_fraction"),
            "bytes_ratio": _med(pub, "bytes_ratio"),
            "zstd_ratio": statistics.median(r["bytes"] / r["bytes_without_zstd"] for r in pub),
            "publish_vs_full": statistics.median(
                r["delta_publish_s"] / r["full_publish_s"] for r in pub
            ),
            "apply_vs_full_swap": statistics.median(
                r["delta_apply_s"] / r["full_swap_s"] for r in apply
            ),
            "bit_exact": all(r["bit_exact"] for r in res["apply"]),
        }
        table.append(line)
        print(
            f"{lr_text:>6} {100 * line['changed_fraction']:>9.2f} "
            f"{100 * line['bytes_ratio']:>8.2f} "
            f"{100 * line['bytes_ratio'] / line['zstd_ratio']:>9.2f} "
            f"{line['publish_vs_full']:>8.2f} {line['apply_vs_full_swap']:>10.2f}"
        )
        headline[f"bytes_ratio_lr{lr_text}"] = line["bytes_ratio"]
    headline["bit_exact"] = all(line["bit_exact"] for line in table)
    headline["apply_vs_full_swap"] = table[0]["apply_vs_full_swap"]
    out = {
        "headline": headline,
        "rows": table,
        "model": {"num_layers": cfg.num_layers, "vocab_size": cfg.vocab_size,
                  "hidden_size": cfg.hidden_size, "engine": "vllm bf16" if FLAGS.swap else None},
        "per_version": results,
        "wall_s": wall_s,
    }  # fmt: skip
    with open(FLAGS.out, "w") as f:
        json.dump(out, f, indent=1)
    print(
        f"bit_exact={headline['bit_exact']}  "
        f"apply_vs_full_swap={headline['apply_vs_full_swap']:.3f}"
    )
    for lr_text in results:
        print(f"bytes_ratio_lr{lr_text} = {headline[f'bytes_ratio_lr{lr_text}']:.4f}")


if __name__ == "__main__":
    app.run(main)
