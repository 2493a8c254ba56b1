"""`python -m bridge.export` of a LoRA checkpoint (adapters only + a reference to the base):
--merge (default) writes an HF model that transformers loads, --adapter_only a PEFT adapter
that peft loads on the base; both score like the learner's LoRA model (the full-weight
parity tolerance, model_test.py: 1e-4). A changed base is refused."""

import os

import jax
import numpy as np
import pytest
import torch
from flax import traverse_util
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM

from bridge import export
from bridge.model import layouts, tiny_model
from learner_jax import lora, lora_state
from learner_jax.model import model, sharding
from learner_jax.training import checkpoint, optim, train_state

peft = pytest.importorskip("peft")

CFG = tiny_model.tiny_config("qwen3")
LORA = lora.LoraConfig(rank=4, alpha=8.0, target_modules=("q", "k", "o", "up", "down"))


def torch_logp(m, ids):
    with torch.no_grad():
        logits = m(input_ids=torch.tensor([ids], dtype=torch.long)).logits[0]
    lp = torch.log_softmax(logits.double(), -1)
    return np.asarray([float(lp[t, ids[t + 1]]) for t in range(len(ids) - 1)])


def test_export_merge_and_adapter_only_load_and_score_like_the_learner(tmp_path):
    base_dir = str(tmp_path / "base")
    tiny_model.make_tiny_model(base_dir, CFG, seed=0)
    weights = tiny_model.random_hf_weights(CFG, 0, std=0.2)
    save_file(weights, os.path.join(base_dir, "model.safetensors"), metadata={"format": "pt"})
    base = layouts.hf_to_flax(CFG, weights)

    mesh = sharding.make_mesh({"fsdp": 2}, jax.devices()[:2])
    opt = optim.make_optimizer(optim.OptimizerConfig())
    _, shardings = train_state.state_shardings(CFG, opt, mesh, lora=LORA)
    state = train_state.state_from_params(CFG, base, opt, mesh, lora=LORA)
    rng = np.random.default_rng(0)
    flat = traverse_util.flatten_dict(jax.device_get(state.params))
    adapters = traverse_util.unflatten_dict(
        {p: (0.2 * rng.standard_normal(v.shape)).astype(np.float32) for p, v in flat.items()}
    )
    state = state.replace(params=jax.device_put(adapters, shardings.params))
    ckpt_dir = str(tmp_path / "ckpt")
    ref = lora_state.base_reference(base_dir, LORA)
    with checkpoint.Checkpointer(ckpt_dir) as ckpt:
        ckpt.save(7, state, {lora_state.CURSOR_KEY: ref}, force=True)
    export.save_model_files(base_dir, ckpt_dir)

    ids = [int(t) for t in rng.integers(3, CFG.vocab_size, 20)]
    tokens = np.asarray([ids[:-1]], np.int32)
    pos = np.arange(len(ids) - 1, dtype=np.int32)[None]
    want = model.forward_logprobs(
        lora.combine(base, adapters),
        CFG,
        tokens,
        pos,
        np.ones_like(tokens),
        np.asarray([ids[1:]], np.int32),
        lora=LORA,
    )
    want = np.asarray(want[0], np.float64)

    merged = export.export(export.ExportOptions(ckpt_dir, str(tmp_path / "merged")))
    assert merged["step"] == 7
    hf = AutoModelForCausalLM.from_pretrained(merged["output_dir"], dtype=torch.float32)
    np.testing.assert_allclose(torch_logp(hf, ids), want, atol=1e-4)
    plain = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    assert np.abs(torch_logp(plain, ids) - want).max() > 1e-2  # the adapters matter

    only = export.export(
        export.ExportOptions(ckpt_dir, str(tmp_path / "adapter"), adapter_only=True)
    )
    assert sorted(os.listdir(only["output_dir"])) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    tensors = load_file(os.path.join(only["output_dir"], "adapter_model.safetensors"))
    assert len(tensors) == 2 * len(LORA.target_modules) * CFG.num_layers
    with_adapter = peft.PeftModel.from_pretrained(plain, only["output_dir"])
    np.testing.assert_allclose(torch_logp(with_adapter, ids), want, atol=1e-4)

    # the base changed under the checkpoint: the merge is refused, nothing written
    weights["model.norm.weight"] = weights["model.norm.weight"] * 2
    save_file(weights, os.path.join(base_dir, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(export.ExportError, match="not the ones the adapters"):
        export.export(export.ExportOptions(ckpt_dir, str(tmp_path / "merged2")))
    assert not os.path.exists(tmp_path / "merged2")
