"""LoRA in the Flax learner (learner_jax/lora.py) against transformers + peft: the same
adapter gives the same log-probs, a fresh adapter is the base model, the PEFT layout round
trips (gradients: lora_train_test.py)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import traverse_util
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM

from bridge.adapters import peft_layout
from bridge.model import layouts, tiny_model
from learner_jax import lora
from learner_jax.model import model

peft = pytest.importorskip("peft")

CONFIGS = {
    "qwen3_tied": tiny_model.tiny_config("qwen3"),
    "qwen2_bias": tiny_model.tiny_config("qwen2", num_kv_heads=1),
}
RANK, ALPHA = 4, 8.0
# jitted: op-by-op dispatch of the unrolled model costs more than its compile
forward_logprobs = jax.jit(model.forward_logprobs, static_argnums=1, static_argnames="lora")


def make_base(path, cfg, seed=0):
    """HF dir with std-0.2 weights (logits large enough for the tolerance to mean something)
    and its Flax params."""
    tiny_model.make_tiny_model(str(path), cfg, seed)
    weights = tiny_model.random_hf_weights(cfg, seed, std=0.2)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path), layouts.hf_to_flax(cfg, weights)


def peft_model(hf_dir, targets, seed=0):
    """A peft LoRA model with a random (nonzero) adapter on `targets`, in float32."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    conf = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=list(targets), init_lora_weights=False
    )
    pm = peft.get_peft_model(base, conf)
    with torch.no_grad():  # B random too, and large enough to move the logits clearly
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    return pm


def peft_tensors(pm) -> dict[str, np.ndarray]:
    state = peft.get_peft_model_state_dict(pm)
    return {k: v.detach().numpy().copy() for k, v in state.items()}


def batch(vocab, seed=0):
    t = 12
    seg = np.ones((3, t), np.int32)
    seg[0, :4] = 0  # left padding
    seg[1, 9:] = 0  # right padding
    tokens = np.random.default_rng(seed).integers(3, vocab, (3, t)).astype(np.int32)
    tokens[seg == 0] = tiny_model.PAD_ID
    return tokens, seg, np.asarray(model.positions_from_segments(jnp.asarray(seg)))


def torch_logp(pm, tokens, seg, pos):
    out = pm(
        input_ids=torch.tensor(tokens, dtype=torch.long),
        attention_mask=torch.tensor(seg > 0, dtype=torch.long),
        position_ids=torch.tensor(pos, dtype=torch.long),
    )
    targets = torch.tensor(np.roll(tokens, -1, axis=1), dtype=torch.long)
    return torch.log_softmax(out.logits, -1).gather(-1, targets[..., None])[..., 0]


@pytest.mark.parametrize(
    "name,targets", [("qwen3_tied", tuple(lora.TARGETS)), ("qwen2_bias", ("q", "v", "down"))]
)
def test_logprobs_match_peft(tmp_path, name, targets):
    cfg = CONFIGS[name]
    hf_dir, base = make_base(tmp_path, cfg)
    modules = [lora.TARGETS[t] for t in targets]
    pm = peft_model(hf_dir, modules)
    tensors = peft_tensors(pm)
    assert len(tensors) == 2 * len(modules) * cfg.num_layers
    adapters = traverse_util.unflatten_dict(peft_layout.from_peft(tensors, cfg))
    lcfg = lora.LoraConfig(rank=RANK, alpha=ALPHA, target_modules=targets)
    tokens, seg, pos = batch(cfg.vocab_size)
    targets_ = np.roll(tokens, -1, axis=1)
    real = (seg > 0) & (np.roll(seg, -1, axis=1) > 0)
    with torch.no_grad():
        ref = torch_logp(pm, tokens, seg, pos).numpy()
    ours = forward_logprobs(
        lora.combine(base, adapters), cfg, tokens, pos, seg, targets_, lora=lcfg
    )
    # the same tolerance as the full-weight parity test (model_test.py)
    np.testing.assert_allclose(np.asarray(ours)[real], ref[real], atol=1e-4, rtol=0)
    # the adapter moves the log-probs far more than the tolerance (the test can fail)
    base_only = forward_logprobs(base, cfg, tokens, pos, seg, targets_)
    assert np.abs(np.asarray(base_only)[real] - ref[real]).max() > 1e-2
    # merged weights (what full-weight workers and `export --merge` get) score the same
    merged = lora.merged_params(base, adapters, lcfg)
    via_merge = forward_logprobs(merged, cfg, tokens, pos, seg, targets_)
    np.testing.assert_allclose(np.asarray(via_merge)[real], ref[real], atol=1e-4, rtol=0)


def test_peft_layout_round_trips_and_rejects_bad_tensors():
    cfg = CONFIGS["qwen3_tied"]
    lcfg = lora.LoraConfig(rank=RANK, alpha=ALPHA)
    shapes = jax.eval_shape(lambda: model._init_boxed(cfg, jax.random.key(1), jnp.float32, lcfg))
    _, adapters = lora.split_params(nn.unbox(shapes))
    flat = traverse_util.flatten_dict(adapters)
    rng = np.random.default_rng(0)
    flat = {p: rng.normal(size=v.shape).astype(np.float32) for p, v in flat.items()}
    tensors = peft_layout.to_peft(flat)
    back = peft_layout.from_peft(tensors, cfg)
    assert set(back) == set(flat)
    for p in flat:
        np.testing.assert_array_equal(back[p], flat[p])
    name = next(n for n in tensors if "o_proj.lora_A" in n)
    with pytest.raises(ValueError, match="shape"):
        peft_layout.from_peft({name: tensors[name][:, :-1]}, cfg)
    with pytest.raises(ValueError, match="PEFT LoRA tensor name"):
        peft_layout.from_peft({"base_model.model.lm_head.lora_A.weight": tensors[name]}, cfg)


def test_fresh_adapter_leaves_the_base_model():
    cfg = CONFIGS["qwen3_tied"]
    lcfg = lora.LoraConfig(rank=RANK, alpha=ALPHA)
    init = jax.jit(lambda k: nn.unbox(model._init_boxed(cfg, k, jnp.float32, lcfg)))
    params = init(jax.random.key(0))
    base, adapters = lora.split_params(params)
    assert set(traverse_util.flatten_dict(base)) == {r.flax_path for r in layouts.table(cfg)}
    tokens, seg, pos = batch(cfg.vocab_size)
    targets = np.roll(tokens, -1, axis=1)
    with_lora = forward_logprobs(params, cfg, tokens, pos, seg, targets, lora=lcfg)
    without = forward_logprobs(base, cfg, tokens, pos, seg, targets)
    np.testing.assert_array_equal(np.asarray(with_lora), np.asarray(without))
    # lora_a is peft's kaiming-uniform (bound 1/sqrt(fan_in)), lora_b zero
    a = adapters["layers_0"]["attn"]["o_proj"]["lora_a"]
    assert a.shape == (cfg.num_heads, cfg.head_dim, RANK)
    bound = 1 / np.sqrt(cfg.num_heads * cfg.head_dim)
    assert 0.5 * bound < np.abs(a).max() <= bound
    assert not np.any(adapters["layers_0"]["attn"]["o_proj"]["lora_b"])


def test_config_is_checked():
    assert lora.from_dict({"rank": 0}) is None
    c = lora.from_dict({"rank": 8, "alpha": 16, "target_modules": "q,v_proj"})
    assert c.target_modules == ("q", "v") and c.module_names == ("q_proj", "v_proj")
    assert c.scale == 2.0
    bad_configs = (
        {"rank": -1},
        {"rank": 4, "alpha": 0},
        {"rank": 4, "dropout": 1.0},
        {"rank": 4, "target_modules": ("lm_head",)},
    )
    for bad in bad_configs:
        with pytest.raises(ValueError):
            lora.from_dict(bad)


def test_dropout_only_with_a_dropout_rng_and_fresh_per_micro_batch():
    """learner.lora.dropout applies where the train step passes a 'dropout' RNG (a fresh
    key per step and micro-batch), never when scoring (no RNG: the deterministic policy).
    On one adapted projection (model.Linear named q_proj), so it costs no model compile."""
    from learner_jax.training import train_step

    drop = lora.LoraConfig(rank=RANK, alpha=ALPHA, dropout=0.5)
    plain = lora.LoraConfig(rank=RANK, alpha=ALPHA)

    def layer(cfg):
        return model.Linear(
            "btd,dnh->btnh", (16, 2, 8), ("embed", "heads", "kv"), lora=cfg, name="q_proj"
        )

    x = jax.random.normal(jax.random.key(0), (2, 3, 16))
    params = nn.unbox(layer(drop).init(jax.random.key(1), x)["params"])
    params["lora_b"] = jnp.full(params["lora_b"].shape, 0.5)  # nonzero: the adapter acts

    def out(cfg, rngs=None):
        return np.asarray(layer(cfg).apply({"params": params}, x, rngs=rngs))

    np.testing.assert_array_equal(out(drop), out(plain))  # scoring: no dropout
    k1, k2 = {"dropout": jax.random.key(1)}, {"dropout": jax.random.key(2)}
    np.testing.assert_array_equal(out(drop, k1), out(drop, k1))
    assert np.abs(out(drop, k1) - out(drop, k2)).max() > 1e-3
    assert np.abs(out(drop, k1) - out(plain)).max() > 1e-3

    state = type("S", (), {"rng": jax.random.key_data(jax.random.PRNGKey(0)), "step": 3})
    cfg_drop = train_step.StepConfig(kind="sft", lora=drop)
    r0 = train_step._dropout_rngs(cfg_drop, state, 0)["dropout"]
    r1 = train_step._dropout_rngs(cfg_drop, state, 1)["dropout"]
    assert not np.array_equal(jax.random.key_data(r0), jax.random.key_data(r1))
    assert train_step._dropout_rngs(train_step.StepConfig(kind="sft"), state, 0) is None
