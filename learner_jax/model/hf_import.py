"""Load an HF checkpoint directory (safetensors) into sharded Flax parameters.

    cfg, params = load_hf_params("/path/to/Qwen3-0.6B", mesh=mesh)

Reads `model.safetensors` or the shards listed in `model.safetensors.index.json` one
tensor at a time, converts each with the `bridge.model.layouts` table (HF `[out, in]` -> Flax),
casts it and places it straight into its target `NamedSharding` with
`jax.make_array_from_callback`, so each device receives only its slice and the host never
holds more than one leaf (a MoE layer's experts are one stacked leaf). Every name, and
every shape, is checked against the architecture before anything is read, so a bad
checkpoint fails with nothing loaded.

Tensors are read from the raw safetensors bytes (8-byte header length, JSON header, data)
rather than `safe_open(framework="numpy")`, which cannot return bfloat16 (`ml_dtypes`
gives numpy that type) — one code path for every dtype.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from bridge.model import hf_files, layouts
from bridge.model.config import ModelConfig
from bridge.model.dtypes import SAFETENSORS_DTYPES
from learner_jax.model import sharding


def read_header(path: str) -> tuple[dict, int]:
    """(name -> {dtype, shape, data_offsets}, byte offset where the data section starts)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def read_tensor(path: str, entry: dict, data_start: int) -> np.ndarray:
    """One tensor from a safetensors file, as numpy in its stored dtype."""
    if entry["dtype"] not in SAFETENSORS_DTYPES:
        raise ValueError(f"{path}: unsupported safetensors dtype {entry['dtype']}")
    begin, end = entry["data_offsets"]
    with open(path, "rb") as f:
        f.seek(data_start + begin)
        raw = f.read(end - begin)
    return np.frombuffer(raw, dtype=SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def checkpoint_index(hf_dir: str) -> dict[str, tuple[str, dict, int]]:
    """HF name -> (file, header entry, data start) over all safetensors files of a dir."""
    out = {}
    for name in hf_files.safetensors_files(hf_dir):
        path = os.path.join(hf_dir, name)
        header, start = read_header(path)
        for tensor, entry in header.items():
            if tensor in out:
                raise ValueError(f"{hf_dir}: tensor {tensor} appears in two files")
            out[tensor] = (path, entry, start)
    return out


def _check(cfg: ModelConfig, index: dict) -> None:
    expected = layouts.hf_shapes(cfg)
    present = {n for n in index if not layouts.is_buffer(n)}
    if cfg.tie_word_embeddings:
        present.discard("lm_head.weight")  # tied checkpoints sometimes still carry a copy
    missing, extra = sorted(set(expected) - present), sorted(present - set(expected))
    if missing or extra:
        raise ValueError(
            f"checkpoint does not match {cfg.architecture}: missing tensors {missing[:8]}, "
            f"unexpected tensors {extra[:8]}"
        )
    for name, shape in expected.items():
        got = tuple(index[name][1]["shape"])
        if got != shape:
            raise ValueError(f"tensor {name} has shape {got}, expected {shape} for this config")


def load_hf_params(
    hf_dir: str,
    mesh: jax.sharding.Mesh | None = None,
    rules: Sequence = sharding.DEFAULT_RULES,
    dtype=jnp.float32,
):
    """(ModelConfig, Flax params) from an HF dir; sharded over `mesh` when given."""
    cfg = ModelConfig.from_hf_dir(hf_dir)
    index = checkpoint_index(hf_dir)
    _check(cfg, index)
    targets = None if mesh is None else sharding.param_shardings(cfg, mesh, rules)
    params: dict = {}
    for path, rows in layouts.leaves(layouts.table(cfg)).items():
        # One converted copy in the target dtype; the raw bytes are dropped right after
        # (a MoE layer's stacked experts are one leaf, read expert by expert).
        host = np.array(
            layouts.leaf_from_hf(rows, lambda name: read_tensor(*index[name])),
            dtype=jnp.dtype(dtype),
            order="C",
        )
        if targets is None:
            leaf = jax.device_put(host)
        else:
            target = layouts.get_leaf(targets, path)
            leaf = jax.make_array_from_callback(host.shape, target, host.__getitem__)
        layouts.set_leaf(params, path, leaf)
        del host  # at most one leaf on host at a time
    return cfg, params
