"""HF safetensors import: single file, sharded with an index, bf16, and refusals."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file
from safetensors.torch import save_file as save_torch

from bridge.model import layouts, tiny_model
from learner_jax.model import hf_import, sharding


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """3-layer Qwen2 (qkv bias) with 1 kv head: exercises bias rows and a replicated dim."""
    cfg = tiny_model.tiny_config("qwen2", num_layers=3, num_kv_heads=1, tie_word_embeddings=False)
    return tiny_model.make_tiny_model(str(tmp_path_factory.mktemp("qwen2")), cfg, seed=4)


def leaves(params):
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}


def assert_same(a, b):
    la, lb = leaves(a), leaves(b)
    assert la.keys() == lb.keys()
    for k in la:
        np.testing.assert_array_equal(np.asarray(la[k]), np.asarray(lb[k]), err_msg=k)


def copy_dir(src, dst, skip=("model.safetensors",)):
    os.makedirs(dst)
    for name in os.listdir(src):
        if name not in skip:
            shutil.copy(os.path.join(src, name), dst)
    return str(dst)


def test_single_file_matches_layout_table(tiny_model_dirs):
    for hf_dir in tiny_model_dirs.values():  # qwen3 tied, qwen2, llama untied
        cfg, params = hf_import.load_hf_params(hf_dir)
        expected = layouts.hf_to_flax(cfg, load_file(os.path.join(hf_dir, "model.safetensors")))
        assert_same(params, expected)
        assert all(x.dtype == jnp.float32 for x in leaves(params).values())


def test_sharded_checkpoint_with_index(qwen2_dir, tmp_path):
    """2 files + index.json, loaded onto a (2, 2, 2) mesh == single-file import."""
    tensors = load_file(os.path.join(qwen2_dir, "model.safetensors"))
    names = sorted(tensors)
    split = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    out = copy_dir(qwen2_dir, tmp_path / "sharded")
    for file, part in split.items():
        save_file({n: tensors[n] for n in part}, os.path.join(out, file), metadata={"format": "pt"})
    weight_map = {n: f for f, part in split.items() for n in part}
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)

    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    cfg, params = hf_import.load_hf_params(out, mesh=mesh)
    _, single = hf_import.load_hf_params(qwen2_dir)
    assert_same(params, single)
    targets = leaves(sharding.param_shardings(cfg, mesh))
    for k, x in leaves(params).items():
        assert x.sharding == targets[k], k
    q = params["layers_0"]["attn"]["q_proj"]["kernel"]
    assert q.addressable_shards[0].data.shape == (32, 2, 32)  # each device got only its slice


def test_bf16_checkpoint(tiny_model_dirs, tmp_path):
    src = tiny_model_dirs["qwen3"]
    out = copy_dir(src, tmp_path / "bf16")
    ref = {
        k: torch.from_numpy(v).to(torch.bfloat16)
        for k, v in load_file(os.path.join(src, "model.safetensors")).items()
    }
    save_torch(ref, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg, params = hf_import.load_hf_params(out)  # bf16 on disk -> fp32 params
    assert_same(params, layouts.hf_to_flax(cfg, {k: v.float().numpy() for k, v in ref.items()}))
    _, bf16 = hf_import.load_hf_params(out, dtype=jnp.bfloat16)
    for k, x in leaves(bf16).items():
        assert x.dtype == jnp.bfloat16
        np.testing.assert_array_equal(
            np.asarray(x).astype(np.float32), np.asarray(leaves(params)[k])
        )
    # and numpy-written bf16 (ml_dtypes), the other writer of this dtype
    save_file(
        {k: v.float().numpy().astype(ml_dtypes.bfloat16) for k, v in ref.items()},
        os.path.join(out, "model.safetensors"),
    )
    assert_same(hf_import.load_hf_params(out)[1], params)


def test_tied_checkpoint_with_lm_head_copy(tiny_model_dirs, tmp_path):
    src = tiny_model_dirs["qwen3"]  # tied
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out = copy_dir(src, tmp_path / "tied")
    extra = dict(tensors, **{"lm_head.weight": tensors["model.embed_tokens.weight"] + 1})
    save_file(extra, os.path.join(out, "model.safetensors"))
    cfg, params = hf_import.load_hf_params(out)
    assert "lm_head" not in params
    assert_same(params, layouts.hf_to_flax(cfg, tensors))


UP1 = "model.layers.1.mlp.up_proj.weight"
Q0 = "model.layers.0.self_attn.q_proj.weight"
UP9 = "model.layers.9.mlp.up_proj.weight"


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda t: t.pop(UP1), f"missing tensors.*{UP1}"),
        (
            lambda t: t.update({Q0: np.zeros((4, 64), np.float32)}),
            rf"tensor {Q0} has shape \(4, 64\), expected \(128, 64\)",
        ),
        (lambda t: t.update({UP9: np.zeros(2, np.float32)}), f"unexpected tensors.*{UP9}"),
    ],
)
def test_bad_checkpoint_is_refused(qwen2_dir, tmp_path, damage, message):
    tensors = load_file(os.path.join(qwen2_dir, "model.safetensors"))
    damage(tensors)
    out = copy_dir(qwen2_dir, tmp_path / "bad")
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        hf_import.load_hf_params(out)


def test_no_weights_is_refused(qwen2_dir, tmp_path):
    out = copy_dir(qwen2_dir, tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        hf_import.load_hf_params(out)
