"""The LoRA train step (learner_jax/lora.py, train_step.py, train_state.py, checkpoint.py):
adapter gradients on an 8-device mesh, packed, rematerialized and micro-batched, against
torch autograd through transformers + peft in float64; only the adapters in the optimizer
state and the checkpoint; the base untouched; resume restores the adapters bitwise.

Tolerance as tests/learner_jax/training/grad_parity_test.py: the JAX step computes in fp32, the
reference in float64, so the difference is fp32 rounding: per leaf ||g - g_ref|| / ||g_ref||
<= 1e-4 (its docstring derives it; the adapter gradients here measure ~1e-6).
"""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
from flax import traverse_util
from float_tolerance import gradient_recorder
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM

from bridge import export
from bridge.adapters import peft_layout
from bridge.model import layouts, tiny_model
from learner_jax import lora
from learner_jax.model import model, sharding
from learner_jax.training import checkpoint, optim, packing, train_state, train_step

peft = pytest.importorskip("peft")

CFG = tiny_model.tiny_config("qwen3")
LORA = lora.LoraConfig(rank=4, alpha=8.0)
REL_TOL = 1e-4
B, T = 16, 20


def make_base(path, seed=0):
    tiny_model.make_tiny_model(str(path), CFG, seed)
    weights = tiny_model.random_hf_weights(CFG, seed, std=0.2)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path), layouts.hf_to_flax(CFG, weights)


def sft_batch(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, CFG.vocab_size, (B, T + 1))
    length = rng.integers(6, T + 2, B)
    valid = np.arange(T + 1)[None, :] < length[:, None]
    tokens = np.where(valid, tokens, 0)
    loss_mask = (np.arange(T + 1)[None, :] >= 3) & valid
    return train_step.make_batch(tokens, loss_mask)


def torch_adapter_grads(hf_dir, tensors, batch):
    """d(SFT loss)/d(adapters) by torch autograd on the peft model, float64, PEFT names."""
    base = AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float64, attn_implementation="eager"
    )
    conf = peft.LoraConfig(
        r=LORA.rank, lora_alpha=LORA.alpha, target_modules=list(LORA.module_names)
    )
    pm = peft.get_peft_model(base, conf)
    peft.set_peft_model_state_dict(
        pm, {k: torch.tensor(v, dtype=torch.float64) for k, v in tensors.items()}
    )
    seg = torch.tensor(np.asarray(batch.segment_ids), dtype=torch.long)
    logits = pm(
        input_ids=torch.tensor(np.asarray(batch.tokens), dtype=torch.long),
        attention_mask=seg,
        position_ids=torch.tensor(np.asarray(batch.positions), dtype=torch.long),
    ).logits
    targets = torch.tensor(np.asarray(batch.targets), dtype=torch.long)
    logp = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    m = torch.tensor(np.asarray(batch.loss_mask), dtype=torch.float64)
    loss = -(logp * m).sum() / m.sum()
    loss.backward()
    return {
        n.replace(".default", ""): p.grad.numpy() for n, p in pm.named_parameters() if "lora_" in n
    }


def random_adapters(seed=1):
    """Nonzero A and B (a fresh B is zero, which would zero every A gradient)."""
    rng = np.random.default_rng(seed)
    boxed = jax.eval_shape(lambda: model._init_boxed(CFG, jax.random.key(0), jnp.float32, LORA))
    _, adapters = lora.split_params(jax.tree.map(lambda x: x.value, boxed, is_leaf=_boxed))
    flat = traverse_util.flatten_dict(adapters)
    return {p: (0.3 * rng.standard_normal(v.shape)).astype(np.float32) for p, v in flat.items()}


def _boxed(x):
    return hasattr(x, "value") and hasattr(x, "names")


def test_adapter_gradients_match_peft_autograd_on_a_sharded_packed_remat_step(tmp_path):
    hf_dir, base = make_base(tmp_path / "base")
    flat = random_adapters()
    batch = sft_batch()
    ref = traverse_util.unflatten_dict(
        peft_layout.from_peft(torch_adapter_grads(hf_dir, peft_layout.to_peft(flat), batch), CFG)
    )

    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    grads_opt = gradient_recorder()
    _, shardings = train_state.state_shardings(CFG, grads_opt, mesh, lora=LORA)
    state = train_state.state_from_params(CFG, base, grads_opt, mesh, seed=0, lora=LORA)
    adapters = traverse_util.unflatten_dict(flat)
    state = state.replace(params=jax.device_put(adapters, shardings.params))
    # adapters sharded by the rule table: the kernel's axes, the rank axis replicated
    q = shardings.params["layers_0"]["attn"]["q_proj"]
    assert q["lora_a"].spec == P("fsdp", None)
    assert q["lora_b"].spec == P(None, "tensor", None)
    # only the adapters train: the optimizer state holds exactly their tree
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(state.params)
    frozen_before = jax.device_get(state.frozen)

    step_cfg = train_step.StepConfig(
        kind="sft", micro_batches=2, model_options=model.ModelOptions(remat="full"), lora=LORA
    )
    step = train_step.jit_step(CFG, grads_opt, step_cfg, mesh, shardings, donate=False)
    packed = packing.pack_batch(batch, 2, shards=4, row_len=2 * T)
    assert packed.pack.tokens.shape[0] < B  # really packed
    new_state, _ = step(state, train_step.put_batch(packed, mesh))
    got = jax.device_get(new_state.opt_state)  # the recorder's state: the step's gradient
    bad = []
    for path, g_ref in traverse_util.flatten_dict(ref).items():
        g = np.asarray(traverse_util.flatten_dict(got)[path], np.float64)
        err = np.linalg.norm(g - g_ref) / np.linalg.norm(g_ref)
        if not err <= REL_TOL:
            bad.append(("/".join(path), err))
    assert not bad, bad
    assert len(traverse_util.flatten_dict(ref)) == 2 * 7 * CFG.num_layers
    for a, b in zip(jax.tree.leaves(frozen_before), jax.tree.leaves(new_state.frozen), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_checkpoint_holds_only_adapters_and_resumes_bitwise(tmp_path):
    _, base = make_base(tmp_path / "base")
    mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
    opt = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-2, total_steps=10))
    abstract, shardings = train_state.state_shardings(CFG, opt, mesh, lora=LORA)
    state = train_state.state_from_params(CFG, base, opt, mesh, seed=3, lora=LORA)
    step_cfg = train_step.StepConfig(kind="sft", lora=LORA)
    step = train_step.jit_step(CFG, opt, step_cfg, mesh, shardings)
    state, metrics = step(state, train_step.put_batch(sft_batch(), mesh))
    assert float(metrics["update_norm"]) > 0
    with checkpoint.Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        ckpt.save(1, state, {"lora_base": {"hf_dir": "x"}}, force=True)
    # what is on disk: the adapters and their moments, no kernel of the base
    meta = ocp.PyTreeCheckpointer().metadata(str(tmp_path / "ckpt" / "1" / "state"))
    assert sorted(meta.item_metadata.tree) == ["opt_state", "params", "rng", "step"]
    saved = traverse_util.flatten_dict(export.restore_params(str(tmp_path / "ckpt"), 1))
    assert saved and all(p[-1] in lora.ADAPTER_LEAVES for p in saved)
    # resume: adapters bitwise, base from the target
    target = abstract.replace(frozen=state.frozen)
    with checkpoint.Checkpointer(str(tmp_path / "ckpt")) as ckpt:
        back, cursor = ckpt.restore(target)
    assert cursor == {"lora_base": {"hf_dir": "x"}}
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a.sharding == b.sharding
