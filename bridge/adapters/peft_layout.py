"""The PEFT adapter layout, both ways (numpy only): what vLLM's `LoRARequest` and
`peft.PeftModel.from_pretrained` load.

    adapter_model.safetensors  one tensor per (layer, projection, A|B), HF names:
        base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight
        base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight
    adapter_config.json        peft's LoraConfig (r, lora_alpha, target_modules, ...)

The learner's adapters (`learner_jax/lora.py`) follow its kernels' [in..., out...] layout:
lora_a [in..., R], lora_b [R, out...]. peft's are torch Linear weights [out, in]:
lora_A.weight [R, in] and lora_B.weight [out, R], with the (heads, head_dim) axes merged
into one N*H axis as in the kernels' own table (bridge/model/layouts.py). So:

    lora_A.weight = lora_a.reshape(-1, R).T      lora_B.weight = lora_b.reshape(R, -1).T
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from bridge.model.config import ModelConfig

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
PREFIX = "base_model.model."
# Flax module (parent, projection) -> HF submodule name.
_HF_PARENT = {"attn": "self_attn", "mlp": "mlp"}
_FLAX_PARENT = {v: k for k, v in _HF_PARENT.items()}
_PROJ_PARENT = {
    "q_proj": "attn",
    "k_proj": "attn",
    "v_proj": "attn",
    "o_proj": "attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight$"
)

FlaxPath = tuple[str, ...]


def kernel_shapes(cfg: ModelConfig, proj: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(input axes, output axes) of a projection's Flax kernel (model.py / layouts.py)."""
    d, f, n, k, h = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
    )
    shapes = {
        "q_proj": ((d,), (n, h)),
        "k_proj": ((d,), (k, h)),
        "v_proj": ((d,), (k, h)),
        "o_proj": ((n, h), (d,)),
        "gate_proj": ((d,), (f,)),
        "up_proj": ((d,), (f,)),
        "down_proj": ((f,), (d,)),
    }
    if proj not in shapes:
        raise ValueError(f"no LoRA layout for projection {proj!r}")
    return shapes[proj]


def hf_name(path: FlaxPath) -> str:
    """PEFT tensor name of a Flax adapter leaf ('layers_3', 'attn', 'q_proj', 'lora_a')."""
    if len(path) != 4 or not path[0].startswith("layers_") or path[3] not in ("lora_a", "lora_b"):
        raise ValueError(f"not a LoRA adapter path: {'/'.join(path)}")
    layer, parent, proj, leaf = path
    if _PROJ_PARENT.get(proj) != parent:
        raise ValueError(f"not a LoRA adapter path: {'/'.join(path)}")
    i = int(layer.removeprefix("layers_"))
    ab = "A" if leaf == "lora_a" else "B"
    return f"{PREFIX}model.layers.{i}.{_HF_PARENT[parent]}.{proj}.lora_{ab}.weight"


def flax_path(name: str) -> FlaxPath:
    m = _NAME.match(name)
    if m is None or _PROJ_PARENT.get(m.group(3)) != _FLAX_PARENT[m.group(2)]:
        raise ValueError(f"not a PEFT LoRA tensor name of this model family: {name!r}")
    i, parent, proj, ab = m.groups()
    return (f"layers_{int(i)}", _FLAX_PARENT[parent], proj, "lora_a" if ab == "A" else "lora_b")


def to_peft(adapters: Mapping[FlaxPath, np.ndarray]) -> dict[str, np.ndarray]:
    """Flax adapter leaves (flat: path -> array) -> PEFT tensors (name -> [out, in] array)."""
    out = {}
    for path, x in adapters.items():
        x = np.asarray(x)
        if path[-1] == "lora_a":
            r = x.shape[-1]
            out[hf_name(path)] = np.ascontiguousarray(x.reshape(-1, r).T)
        else:
            r = x.shape[0]
            out[hf_name(path)] = np.ascontiguousarray(x.reshape(r, -1).T)
    return out


def from_peft(tensors: Mapping[str, np.ndarray], cfg: ModelConfig) -> dict[FlaxPath, np.ndarray]:
    """PEFT tensors -> Flax adapter leaves (flat), checking every shape against `cfg`."""
    out = {}
    for name, x in tensors.items():
        path = flax_path(name)
        if int(path[0].removeprefix("layers_")) >= cfg.num_layers:
            raise ValueError(f"{name}: the model has {cfg.num_layers} layers")
        ins, outs = kernel_shapes(cfg, path[2])
        x = np.asarray(x)
        if x.ndim != 2:
            raise ValueError(f"{name}: expected a 2-d tensor, got shape {x.shape}")
        if path[-1] == "lora_a":
            r = x.shape[0]
            if x.shape[1] != int(np.prod(ins)):
                raise ValueError(f"{name}: shape {x.shape}, want [R, {int(np.prod(ins))}]")
            out[path] = x.T.reshape(*ins, r)
        else:
            r = x.shape[1]
            if x.shape[0] != int(np.prod(outs)):
                raise ValueError(f"{name}: shape {x.shape}, want [{int(np.prod(outs))}, R]")
            out[path] = x.T.reshape(r, *outs)
    ranks = {v.shape[-1] if p[-1] == "lora_a" else v.shape[0] for p, v in out.items()}
    if len(ranks) > 1:
        raise ValueError(f"adapter tensors disagree on the rank: {sorted(ranks)}")
    return out


def adapter_config(
    rank: int,
    alpha: float,
    target_modules: list[str],
    dropout: float = 0.0,
    base_model: str | None = None,
) -> dict[str, Any]:
    """peft's adapter_config.json for a plain LoRA on a causal LM (no bias, no rslora)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(rank),
        "lora_alpha": float(alpha),
        "lora_dropout": float(dropout),
        "target_modules": sorted(target_modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
        "base_model_name_or_path": base_model,
    }


def write_adapter_dir(path: str, tensors: Mapping[str, np.ndarray], config: Mapping) -> str:
    """Write adapter_model.safetensors + adapter_config.json into `path`; returns `path`."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    save_file(
        {k: np.ascontiguousarray(v) for k, v in tensors.items()},
        os.path.join(path, WEIGHTS_FILE),
        metadata={"format": "pt"},
    )
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(dict(config), f, indent=2)
    return path


def read_adapter_dir(path: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """(PEFT tensors, adapter_config) of a PEFT adapter directory."""
    from safetensors.numpy import load_file

    with open(os.path.join(path, CONFIG_FILE)) as f:
        config = json.load(f)
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
    return load_file(os.path.join(path, WEIGHTS_FILE)), config
