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
which goes first.

Then the rollout side's hot swap (`--swap`, default on): a vLLM engine (bfloat16, eager,
`rollout_gpu.vllm_engine.VllmEngine`) is started on an HF dir of the same model (random bf16
weights, the char tokenizer of `bridge/model/tiny_model.py`), two versions are published to a
store, and each repeat loads the other version, split the way
`rollout_gpu.weight_swap.load_version` runs it:
  swap_fetch_s  store.read_all: read + verify every checksum (as fetch_s above)
  swap_s        swap_weights: validate names/shapes/finiteness + `load_weights` in place
                (vLLM reload_weights + tied-layer reprocessing + prefix-cache reset)
  validate_s    of which: the validation alone (timed once more on its own)
  load_version_s  the whole `load_version` call (fetch + swap), timed separately
  canary_s      check_canary on 4 probes of 25 tokens (payload scored by the engine itself,
                so only its cost is measured; the published versions carry no canary)
The fp32 host copy is dropped before vLLM starts (whole run: ~10.5 GB peak RSS, ~4 min).

    python -m bench.weight_bridge --out=/tmp/bench_bridge.json [--repeats=3] [--num_layers=28] \
        [--noswap]
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

from bridge.model import layouts, tiny_model
from bridge.model.config import ModelConfig
from bridge.model.presets import qwen3_0p6b
from bridge.store.weight_store import WeightStore

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "JSON file for the results.", required=True)
flags.DEFINE_integer("repeats", 3, "Timed repeats (medians are reported).")
flags.DEFINE_integer("num_layers", 28, "Decoder layers (28 = Qwen3-0.6B).")
flags.DEFINE_string("workdir", None, "Scratch directory on the disk to test (default: tmp).")
flags.DEFINE_bool("swap", True, "Also time the hot swap into a vLLM engine (bf16).")
flags.DEFINE_integer("swap_repeats", 3, "Timed hot swaps.")


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


def write_engine_dir(path: str, cfg: ModelConfig, weights) -> None:
    """An HF dir vLLM starts from: config, char tokenizer, the weights in bf16."""
    from safetensors.numpy import save_file

    os.makedirs(path)
    tiny_model.write_hf_config(path, cfg, dtype="bfloat16")
    tiny_model.save_tokenizer(path)
    save_file(
        {n: a.astype(ml_dtypes.bfloat16) for n, a in weights.items()},
        os.path.join(path, "model.safetensors"),
        metadata={"format": "pt"},
    )


def measure_swap(cfg: ModelConfig, model_dir: str, store: WeightStore, repeats: int) -> dict:
    """Hot-swap timings into a fresh bf16 vLLM engine (store versions 1 and 2 exist)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engine
    from bridge.contracts import canary as canary_lib
    from rollout_gpu import canary as engine_canary
    from rollout_gpu import weight_swap
    from rollout_gpu.vllm_engine import VllmEngine

    t = time.perf_counter()
    engine = VllmEngine.start(model_dir, dtype="bfloat16", max_model_len=256, max_num_seqs=8)
    probes = canary_lib.probe_token_lists(len(tiny_model.char_vocab()), tiny_model.BOS_ID)
    engine_canary.engine_prompt_logprobs(engine, probes)  # first forward compiles kernels
    startup_s = time.perf_counter() - t
    shapes = layouts.hf_shapes(cfg)
    current = weight_swap.EngineVersion()
    runs = []
    for r in range(repeats):
        version = 1 + r % 2
        fetch_s, tensors = timed(store.read_all, version)
        validate_s, _ = timed(weight_swap.validate_tensors, tensors, shapes)  # part of swap_s
        swap_s, _ = timed(weight_swap.swap_weights, engine, tensors, shapes, current)
        current.version, current.tensors = version, tensors
        del tensors
        # The whole call the worker makes (fetch + swap), on the other version.
        other = 1 + (r + 1) % 2
        load_s, _ = timed(weight_swap.load_version, engine, store, other, current)
        assert current.version == other
        payload = canary_lib.canary_payload(
            probes, engine_canary.engine_prompt_logprobs(engine, probes)
        )
        canary_s, res = timed(engine_canary.check_canary, engine, payload, "bfloat16")
        assert res.ok, res
        runs.append(
            {
                "swap_fetch_s": fetch_s,
                "swap_s": swap_s,
                "validate_s": validate_s,
                "load_version_s": load_s,
                "canary_s": canary_s,
            }
        )
        print(f"swap {r}: " + ", ".join(f"{k}={v:.2f}" for k, v in runs[-1].items()))
    del engine
    med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
    return {**med, "engine_startup_s": startup_s, "swap_repeats": runs}


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
        swap = None
        if FLAGS.swap:
            # Two versions to alternate between; the second one is the negated weights.
            swap_store = WeightStore(f"file://{os.path.join(scratch, 'swap_store')}")
            swap_store.publish(1, 1, weights.items(), cfg.to_hf_dict())
            swap_store.publish(2, 2, ((n, -a) for n, a in weights.items()), cfg.to_hf_dict())
            engine_dir = os.path.join(scratch, "engine_model")
            write_engine_dir(engine_dir, cfg, weights)
            del weights  # the engine and the fetched versions are bf16 from here on
            swap = measure_swap(cfg, engine_dir, swap_store, FLAGS.swap_repeats)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
    result = {
        "model": f"qwen3-0.6B-shaped ({cfg.num_layers} layers), random weights",
        "dtype": "bfloat16",
        "bytes": nbytes,
        **med,
        "ratio": (med["publish_s"] + med["fetch_s"]) / (med["raw_write_s"] + med["raw_read_s"]),
        "swap_s": None if swap is None else swap["swap_s"],
        "swap_note": (
            "not measured (--noswap)"
            if swap is None
            else "swap_weights alone: validate + vLLM reload_weights (bf16 engine) + "
            "tied-layer reprocessing + prefix-cache reset; fetch/verify is swap_fetch_s"
        ),
        **({} if swap is None else {k: v for k, v in swap.items() if k != "swap_s"}),
        "repeats": runs,
        "cpus": os.cpu_count(),
    }
    gb = nbytes / 1e9
    print(f"\n{'':12s}{'store s':>10s}{'numpy s':>10s}{'store GB/s':>12s}{'numpy GB/s':>12s}")
    for label, a, b in (("write", "publish_s", "raw_write_s"), ("read", "fetch_s", "raw_read_s")):
        print(f"{label:12s}{med[a]:10.2f}{med[b]:10.2f}{gb / med[a]:12.2f}{gb / med[b]:12.2f}")
    print(f"bytes {nbytes} ({gb:.2f} GB), ratio {result['ratio']:.2f} (target <= 2.0)")
    if swap is not None:
        print(f"\nvLLM hot swap (bf16 engine, startup {swap['engine_startup_s']:.1f} s), medians:")
        for key in ("swap_fetch_s", "swap_s", "validate_s", "load_version_s", "canary_s"):
            print(f"{key:16s}{swap[key]:10.2f}")
    with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
