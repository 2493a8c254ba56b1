"""LoRA checkpoints in `python -m bridge.export` (numpy only; orbax imported lazily).

A LoRA run's checkpoint holds only the adapters (`state/params` = lora_a / lora_b leaves)
and, in its cursor, `lora_base`: the base HF directory, a SHA-256 over its safetensors
files and the LoRA config (learner_jax/lora_state.py). The export either

  --merge (default)   reads the base weights (checked against the digest), adds
                      (alpha / R) * lora_B @ lora_A to each adapted HF weight in float32,
                      and writes a plain HF model directory, or
  --adapter_only      writes the PEFT adapter directory (adapter_model.safetensors +
                      adapter_config.json) that peft and vLLM's LoRARequest load on the base.

The merge is done here in HF layout ([out, in]), independently of the learner's Flax-side
merge (`learner_jax.lora.merged_params`); tests compare the two through transformers.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from bridge.adapters import peft_layout
from bridge.model import layouts
from bridge.model.config import ModelConfig

CURSOR_KEY = "lora_base"
_A_NAME = re.compile(r"^base_model\.model\.(.+)\.lora_A\.weight$")


def weights_digest(hf_dir: str) -> str:
    """SHA-256 over the HF directory's safetensors files (names and bytes, sorted)."""
    h = hashlib.sha256()
    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
    for path in files:
        h.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


def is_adapter_tree(params: Mapping) -> bool:
    """Whether a checkpoint's `params` are a LoRA run's adapters (not a full model)."""

    def leaves(tree, path=()):
        if not isinstance(tree, Mapping):
            yield path
            return
        for k, v in tree.items():
            yield from leaves(v, (*path, k))

    return any(p[-1] in ("lora_a", "lora_b") for p in leaves(params))


def restore_reference(checkpoint_dir: str, step: int) -> dict[str, Any]:
    """The `lora_base` reference in the cursor of `step`."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    with ocp.CheckpointManager(os.path.abspath(checkpoint_dir), options=options) as mngr:
        cursor = mngr.restore(step, args=ocp.args.Composite(cursor=ocp.args.JsonRestore()))
    ref = dict(cursor["cursor"] or {}).get(CURSOR_KEY)
    if not ref:
        raise ValueError(f"step {step} holds adapters but its cursor names no base model")
    return ref


def peft_tensors(params: Mapping) -> dict[str, np.ndarray]:
    """The checkpoint's adapter tree -> PEFT tensors."""
    flat: dict[tuple[str, ...], np.ndarray] = {}

    def walk(tree, path=()):
        if isinstance(tree, Mapping):
            for k, v in tree.items():
                walk(v, (*path, k))
        else:
            flat[path] = np.asarray(tree, np.float32)

    walk(params)
    return peft_layout.to_peft(flat)


def adapter_config_for(ref: Mapping, tensors: Mapping[str, np.ndarray]) -> dict[str, Any]:
    lora = ref["lora"]
    targets = sorted({n.split(".")[-3] for n in tensors})  # ...{proj}.lora_A.weight
    return peft_layout.adapter_config(
        lora["rank"], lora["alpha"], targets, lora.get("dropout", 0.0), ref.get("hf_dir")
    )


def load_base(ref: Mapping, base_dir: str | None = None) -> dict[str, np.ndarray]:
    """The base's HF tensors, from `base_dir` or the reference's hf_dir, digest-checked."""
    from safetensors.numpy import load_file

    path = base_dir or ref["hf_dir"]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"the base model {path} is gone; pass --base_dir")
    digest = weights_digest(path)
    if digest != ref["weights_sha256"]:
        raise ValueError(
            f"base weights in {path} (sha256 {digest[:12]}) are not the ones the adapters "
            f"were trained on (sha256 {ref['weights_sha256'][:12]})"
        )
    out: dict[str, np.ndarray] = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(f))
    return out


def merge_hf(
    base: Mapping[str, np.ndarray], tensors: Mapping[str, np.ndarray], scale: float
) -> dict[str, np.ndarray]:
    """HF weights with W += scale * lora_B @ lora_A on every adapted module (float32 math,
    the base's dtype kept)."""
    out = dict(base)
    for name, a in tensors.items():
        m = _A_NAME.match(name)
        if m is None:
            continue
        module = m.group(1)
        b = tensors[f"base_model.model.{module}.lora_B.weight"]
        w = base[f"{module}.weight"]
        delta = scale * (np.asarray(b, np.float32) @ np.asarray(a, np.float32))
        out[f"{module}.weight"] = (np.asarray(w, np.float32) + delta).astype(w.dtype)
    return out


def merged_flax_params(
    cfg: ModelConfig, params: Mapping, ref: Mapping, base_dir: str | None = None
) -> dict:
    """The Flax parameter tree of base + adapters merged (what `write_hf_dir` takes)."""
    tensors = peft_tensors(params)
    scale = float(ref["lora"]["alpha"]) / int(ref["lora"]["rank"])
    merged = merge_hf(load_base(ref, base_dir), tensors, scale)
    merged = {k: v for k, v in merged.items() if not k.endswith(layouts.BUFFER_SUFFIXES)}
    return layouts.hf_to_flax(cfg, merged)
