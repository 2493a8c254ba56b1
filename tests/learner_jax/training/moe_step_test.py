"""The jitted train step on a Qwen3-MoE: experts sharded over the mesh (expert parallel
over fsdp=4, expert width over tensor=2) == one device, with routing replay on and the
load-balancing loss in the objective; replay changes the step; agreement is reported.

Weights are std 0.2 (transformers-style HF weights through the layout table), so the
router's top-k is far from ties (checked): the two meshes then choose the same experts and
differ by float32 rounding only (float_tolerance.py), as the dense step does.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from float_tolerance import assert_close_at_scale, assert_trees_close_at_scale, gradient_recorder

from bridge.model import layouts, tiny_model
from learner_jax.model import model, sharding
from learner_jax.training import losses, train_state, train_step

CFG = tiny_model.tiny_config("qwen3_moe", num_layers=3, mlp_only_layers=(1,))
B, T = 8, 12
GRADS = gradient_recorder()
MESH_8 = {"fsdp": 4, "tensor": 2}
TIE_GAP = 2e-5


def make_batch(seed=0):
    """RL rows of different lengths with routing recorded for every input token: random
    distinct experts (what a disagreeing engine would send)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, CFG.vocab_size, (B, T + 1))
    length = rng.integers(7, T + 2, B)
    valid = np.arange(T + 1)[None, :] < length[:, None]
    tokens = np.where(valid, tokens, 0)
    loss_mask = (np.arange(T + 1)[None, :] >= 3) & valid
    batch = train_step.make_batch(
        tokens,
        loss_mask,
        behavior_logp=np.log(1.0 / CFG.vocab_size) + 0.3 * rng.standard_normal((B, T)),
        advantages=rng.standard_normal(B),
        on_policy=np.ones(B, np.float32),
    )
    k, layers = CFG.num_experts_per_tok, len(CFG.moe_layers)
    routing = np.argsort(rng.random((B, T, layers, CFG.num_experts)), -1)[..., :k]
    return dataclasses.replace(batch, routing=routing.astype(np.int32))


@functools.cache
def params():
    return layouts.hf_to_flax(CFG, tiny_model.random_hf_weights(CFG, seed=1, std=0.2))


def run_step(mesh_shape, step_cfg, batch):
    n = int(np.prod(list(mesh_shape.values())))
    mesh = sharding.make_mesh(mesh_shape, jax.devices()[:n])
    _, shardings = train_state.state_shardings(CFG, GRADS, mesh)
    state = train_state.state_from_params(CFG, params(), GRADS, mesh, sharding.DEFAULT_RULES, 0)
    step = train_step.jit_step(CFG, GRADS, step_cfg, mesh, shardings, donate=False)
    new_state, metrics = step(state, train_step.put_batch(batch, mesh))
    return new_state, jax.device_get(metrics)


def own_routing_gap(batch):
    """The smallest gap between the k-th and (k+1)-th router probability of a real token."""
    net = model.Transformer(CFG)
    _, state = net.apply(
        {"params": params()}, batch.tokens, batch.positions, batch.segment_ids, mutable=["moe"]
    )
    x = np.asarray(model._routing(CFG, state).router_logits, np.float64)[:, batch.segment_ids > 0]
    p = np.exp(x - x.max(-1, keepdims=True))
    p = np.sort(p / p.sum(-1, keepdims=True), -1)
    k = CFG.num_experts_per_tok
    return (p[..., -k] - p[..., -k - 1]).min()


RL = train_step.StepConfig(kind="rl", loss=losses.LossConfig(name="grpo"))


def test_expert_sharded_step_equals_single_device_with_replay():
    batch = make_batch()
    assert own_routing_gap(batch) > TIE_GAP
    cfg = dataclasses.replace(RL, routing_replay="rollout")
    one, m1 = run_step({"data": 1}, cfg, batch)
    eight, m8 = run_step(MESH_8, cfg, batch)
    # Experts split over fsdp (whole experts per device), their width over tensor.
    spec = train_state.spec_tree(eight).params
    experts = spec["layers_0"]["mlp"]["experts"]
    assert experts["gate_proj"] == jax.sharding.PartitionSpec("fsdp", None, "tensor")
    assert experts["down_proj"] == jax.sharding.PartitionSpec("fsdp", "tensor", None)
    leaf = eight.params["layers_2"]["mlp"]["experts"]["up_proj"]
    assert leaf.sharding.shard_shape(leaf.shape) == (CFG.num_experts // 4, CFG.hidden_size, 16)
    # The step's raw gradient (gradient_recorder) and its metrics agree at fp32 rounding.
    g1, g8 = jax.device_get(one.opt_state), jax.device_get(eight.opt_state)
    assert_trees_close_at_scale(g8, g1)
    assert_close_at_scale(m8["loss"], m1["loss"], scale=np.log(CFG.vocab_size))
    assert_close_at_scale(m8["moe/aux_loss"], m1["moe/aux_loss"])
    assert m1["moe/aux_loss"] > 0
    # Router and expert gradients are real (the loss reaches them through replay).
    router = np.abs(g1["layers_0"]["mlp"]["gate"]["kernel"]).max()
    assert router > 1e-4
    for name in ("moe/routing_agreement", "moe/routing_agreement/layer_0"):
        assert m8[name] == pytest.approx(m1[name], abs=1e-7)
        assert 0.0 < m1[name] < 1.0  # random recorded experts agree only partly
    assert m1["audit_rows/routing_agree"].shape == (B,)


def test_replay_changes_the_step_and_needs_routing():
    """routing_replay='rollout' trains on the recorded experts: a different loss and
    gradient than 'off' on the same batch; without recorded routing it refuses."""
    batch = make_batch(seed=1)
    assert own_routing_gap(batch) > TIE_GAP
    off, m_off = run_step({"data": 1}, RL, batch)
    on, m_on = run_step({"data": 1}, dataclasses.replace(RL, routing_replay="rollout"), batch)
    assert abs(m_on["loss"] - m_off["loss"]) > 1e-3 * abs(m_off["loss"])
    # Agreement is the learner's own routing against the record, with or without replay
    # of the first MoE layer (same input, same router).
    assert m_on["moe/routing_agreement/layer_0"] == m_off["moe/routing_agreement/layer_0"]
    with pytest.raises(ValueError, match="recorded routing"):
        run_step(
            {"data": 1},
            dataclasses.replace(RL, routing_replay="rollout"),
            dataclasses.replace(batch, routing=None),
        )
