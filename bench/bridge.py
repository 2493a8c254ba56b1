"""Weight-bridge benchmark: publish + fetch/verify through the WeightStore vs plain numpy files.

A Qwen3-0.6B-shaped model (vocab 151936, hidden 1024, mlp 3072, 28 layers, 16 heads, 8 kv
heads, head_dim 128, tied, q/k norm) with random fp32 HF tensors, as the learner holds
them on the host. Per repeat, on the same disk:
  publish_s    WeightStore.publish(dtype=bfloat16): cast, chunk, checksum, write (file
               driver, fsynced), manifest last
  fetch_s      WeightStore.read_all: read every array and verify its checksum
  raw_write_s  plain numpy doing the same job: cast to bf16, np.save per array, fsync
  raw_read_s   np.load per array
ratio = (publish_s + fetch_s) / (raw_write_s + raw_read_s), medians over the repeats.
Reads follow writes, so both sides read from the page cache; the two sides alternate
which goes first. swap_s (vLLM hot swap) is
measured by the rollout side's benchmark and left null here.

    python -m bench.bridge --out=/tmp/bench_bridge.json [--repeats=3] [--num_layers=28]
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time

import ml_dtypes
import numpy as np
from absl import app, flags

from bridge import layouts
from bridge.model_config import ModelConfig
from bridge.weight_store import WeightStore

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "JSON file for the results.", required=True)
flags.DEFINE_integer("repeats", 3, "Timed repeats (medians are reported).")
flags.DEFINE_integer("num_layers", 28, "Decoder layers (28 = Qwen3-0.6B).")
flags.DEFINE_string("workdir", None, "Scratch directory on the disk to test (default: tmp).")


def qwen3_0p6b(num_layers: int = 28) -> ModelConfig:
    return ModelConfig(
        family="qwen3",
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_layers=num_layers,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        qk_norm=True,
        max_position_embeddings=40960,
    )


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        name: rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        for name, shape in layouts.hf_shapes(cfg).items()
    }


def raw_write(weights: dict[str, np.ndarray], root: str) -> None:
    os.makedirs(root)
    for i, x in enumerate(weights.values()):
        with open(os.path.join(root, f"{i}.npy"), "wb") as f:
            # bf16 saved as its uint16 bits: np.load of an ml_dtypes .npy needs pickling.
            np.save(f, x.astype(ml_dtypes.bfloat16).view(np.uint16))
            f.flush()
            os.fsync(f.fileno())


def raw_read(weights: dict[str, np.ndarray], root: str) -> dict[str, np.ndarray]:
    return {
        name: np.load(os.path.join(root, f"{i}.npy")).view(ml_dtypes.bfloat16)
        for i, name in enumerate(weights)
    }


def timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def via_store(store: WeightStore, cfg: ModelConfig, weights, nbytes: int) -> dict[str, float]:
    publish_s, manifest = timed(store.publish, 0, 0, weights.items(), cfg.to_hf_dict())
    assert manifest.total_bytes == nbytes and manifest.dtype == "bfloat16"
    fetch_s, _ = timed(store.read_all, 0)
    return {"publish_s": publish_s, "fetch_s": fetch_s}


def via_numpy(weights, root: str) -> dict[str, float]:
    raw_write_s, _ = timed(raw_write, weights, root)
    raw_read_s, _ = timed(raw_read, weights, root)
    return {"raw_write_s": raw_write_s, "raw_read_s": raw_read_s}


def main(argv):
    del argv
    cfg = qwen3_0p6b(FLAGS.num_layers)
    weights = random_weights(cfg)
    nbytes = sum(x.size * 2 for x in weights.values())
    scratch = tempfile.mkdtemp(prefix="bench_bridge_", dir=FLAGS.workdir)
    runs = []
    try:
        for r in range(FLAGS.repeats):
            store_dir, raw_dir = (
                os.path.join(scratch, f"store{r}"),
                os.path.join(scratch, f"raw{r}"),
            )
            store = WeightStore(f"file://{store_dir}")
            sides = [(via_store, (store, cfg, weights, nbytes)), (via_numpy, (weights, raw_dir))]
            run = {}
            # Alternate which side goes first: the first one's dirty pages slow the second.
            for fn, args in sides if r % 2 == 0 else sides[::-1]:
                run.update(fn(*args))
            runs.append(run)
            print(f"repeat {r}: " + ", ".join(f"{k}={v:.2f}" for k, v in runs[-1].items()))
            shutil.rmtree(store_dir)
            shutil.rmtree(raw_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
    result = {
        "model": f"qwen3-0.6B-shaped ({cfg.num_layers} layers), random weights",
        "dtype": "bfloat16",
        "bytes": nbytes,
        **med,
        "ratio": (med["publish_s"] + med["fetch_s"]) / (med["raw_write_s"] + med["raw_read_s"]),
        "swap_s": None,
        "swap_note": "vLLM hot swap is measured by the rollout-side benchmark, not here",
        "repeats": runs,
        "cpus": os.cpu_count(),
    }
    gb = nbytes / 1e9
    print(f"\n{'':12s}{'store s':>10s}{'numpy s':>10s}{'store GB/s':>12s}{'numpy GB/s':>12s}")
    for label, a, b in (("write", "publish_s", "raw_write_s"), ("read", "fetch_s", "raw_read_s")):
        print(f"{label:12s}{med[a]:10.2f}{med[b]:10.2f}{gb / med[a]:12.2f}{gb / med[b]:12.2f}")
    print(f"bytes {nbytes} ({gb:.2f} GB), ratio {result['ratio']:.2f} (target <= 2.0)")
    with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
