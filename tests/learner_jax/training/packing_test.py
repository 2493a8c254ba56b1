"""Sequence packing changes memory, not math: a packed step (fewer, fuller rows) gives the
unpacked step's loss, metrics, per-row audit sums and gradient within float32 rounding of
their scale (tests/float_tolerance.py), for the RL losses and SFT, with micro-batches and
on 8 devices; any [B, T] mask rides along."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from float_tolerance import assert_close_at_scale, assert_trees_close_at_scale, gradient_recorder

from bridge.model import tiny_model
from learner_jax.model import model, sharding
from learner_jax.training import losses, packing, train_state, train_step

CFG = tiny_model.tiny_config("qwen3")
B, T = 16, 24
# The step's optimizer keeps the raw gradient: packed vs unpacked is compared before Adam,
# whose division by sqrt(v) would amplify rounding of tiny gradient entries to ~lr.
OPT = gradient_recorder()


def variable_batch(seed=0):
    """Rows of 4..T+1 tokens (most short, as real answers are), a dropped row, loss-mask
    holes inside completions (like an environment's tokens in a multi-turn episode)."""
    rng = np.random.default_rng(seed)
    length = np.where(rng.random(B) < 0.75, rng.integers(4, 10, B), rng.integers(10, T + 2, B))
    valid = np.arange(T + 1)[None, :] < length[:, None]
    tokens = np.where(valid, rng.integers(3, CFG.vocab_size, (B, T + 1)), 0)
    prompt = rng.integers(1, 4, B)
    loss_mask = (np.arange(T + 1)[None, :] >= prompt[:, None]) & valid
    loss_mask &= rng.random((B, T + 1)) > 0.2  # holes: masked tokens inside the answer
    seq_mask = np.ones(B)
    seq_mask[3] = 0.0
    return train_step.make_batch(
        tokens,
        loss_mask,
        valid=valid,
        behavior_logp=np.log(1.0 / CFG.vocab_size) + 0.3 * rng.standard_normal((B, T)),
        advantages=rng.standard_normal(B),
        seq_mask=seq_mask,
        on_policy=(np.arange(B) % 2).astype(np.float32),
    )


@functools.cache
def initial_state(mesh_items):
    mesh_shape = dict(mesh_items)
    n = int(np.prod(list(mesh_shape.values())))
    mesh = sharding.make_mesh(mesh_shape, jax.devices()[:n])
    _, shardings = train_state.state_shardings(CFG, OPT, mesh)
    return mesh, train_state.create_train_state(CFG, OPT, mesh, seed=0), shardings


def run_step(mesh_shape, step_cfg, batch):
    mesh, state, shardings = initial_state(tuple(sorted(mesh_shape.items())))
    step = train_step.jit_step(CFG, OPT, step_cfg, mesh, shardings, donate=False)
    new_state, metrics = step(state, train_step.put_batch(batch, mesh))
    return jax.device_get(new_state.opt_state), jax.device_get(metrics)  # gradient, metrics


CASES = [
    ("grpo", 1, {"data": 1}),
    ("dapo", 2, {"data": 1}),
    ("gspo", 1, {"data": 2, "fsdp": 2, "tensor": 2}),
    ("sft", 2, {"data": 2, "tensor": 2}),
]


@pytest.mark.parametrize("loss, micro, mesh", CASES, ids=[f"{c[0]}-k{c[1]}" for c in CASES])
def test_packed_step_equals_unpacked(loss, micro, mesh):
    kind = "sft" if loss == "sft" else "rl"
    step_cfg = train_step.StepConfig(
        kind=kind, loss=losses.LossConfig(name="grpo" if kind == "sft" else loss),
        micro_batches=micro, model_options=model.ModelOptions(attention="xla"),
        temperature=1.0 if kind == "sft" else 0.8,
    )  # fmt: skip
    batch = variable_batch(seed=len(loss) + micro)
    shards = mesh.get("data", 1) * mesh.get("fsdp", 1)
    packed = packing.pack_batch(batch, micro, shards)
    assert packed.pack.tokens.shape[0] < B  # the point: fewer rows for the same sequences
    ref_grads, ref = run_step(mesh, step_cfg, batch)
    got_grads, got = run_step(mesh, step_cfg, packed)
    assert set(got) == set(ref)
    log_v = np.log(CFG.vocab_size)  # size of one token's log-prob, the terms summed below
    for name, want in ref.items():
        # Per-row audit sums add up to T log-prob-sized terms; metrics are means of them.
        scale = T * log_v if name.startswith(train_step.ROWS) else max(np.abs(want).max(), log_v)
        assert_close_at_scale(got[name], want, scale=scale, err_msg=name)
    assert_trees_close_at_scale(got_grads, ref_grads)


def test_pack_and_unpack_place_every_token():
    batch = variable_batch(seed=5)
    packed = packing.pack_batch(batch, micro_batches=2, shards=2, row_len=T)
    p = packed.pack
    r = p.tokens.shape[0]
    assert r % 4 == 0 and r < B  # k * (rows per micro-batch, a multiple of the shards)
    seg = np.asarray(batch.segment_ids)
    # Micro-batch i (strided rows) holds exactly micro-batch i's sequences.
    split = jax.tree.map(lambda x: np.asarray(train_step._split(x, 2)), packed)
    for i in range(2):
        mb = jax.tree.map(lambda x, i=i: x[i], split)
        back = np.asarray(packing.unpack(mb.pack.tokens, mb.pack, T))
        np.testing.assert_array_equal(back, mb.tokens * (mb.segment_ids > 0))
        pos = np.asarray(packing.unpack(mb.pack.positions, mb.pack, T))
        np.testing.assert_array_equal(pos, mb.positions * (mb.segment_ids > 0))
    # Segments: ids 1.. within a row, positions restart per segment, no token lost.
    assert (p.segment_ids > 0).sum() == (seg > 0).sum()
    for row_seg, row_pos in zip(p.segment_ids, p.positions, strict=True):
        for s in set(row_seg[row_seg > 0].tolist()):
            np.testing.assert_array_equal(row_pos[row_seg == s], np.arange((row_seg == s).sum()))


def test_packing_refuses_what_it_cannot_hold():
    batch = variable_batch()
    with pytest.raises(ValueError, match="does not fit a packed row of 4"):
        packing.pack_batch(batch, 1, row_len=4)
    with pytest.raises(ValueError, match="micro-batches"):
        packing.pack_batch(batch, 3)
    left_padded = dataclasses.replace(batch, segment_ids=np.asarray(batch.segment_ids)[:, ::-1])
    with pytest.raises(ValueError, match="right-padded"):
        packing.pack_batch(left_padded, 1)
