"""Orbax checkpoints: kill-and-resume reproduces an uninterrupted run exactly, restores onto
another mesh, keeps N, and rejects a bad cursor before writing anything.

The trajectories are real RL data, not fixtures: each step samples completions from the
policy itself (JAX, on the sharded params) with a key derived from the checkpointed RNG
and step, tags them with the version that sampled them, scores them, and trains on them.
So any difference in restored params, optimizer state, step or RNG changes the next
samples and losses.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bridge.model import tiny_model
from learner_jax.model import model, sharding
from learner_jax.training import advantages, checkpoint, losses, optim, train_state, train_step

CFG = tiny_model.tiny_config("qwen3")
G, N, PROMPT, GEN = 4, 4, 4, 6  # groups, samples per group, prompt and completion lengths
OPT = optim.make_optimizer(
    optim.OptimizerConfig(learning_rate=3e-3, warmup_steps=1, total_steps=20, eps=1e-5)
)
STEP_CFG = train_step.StepConfig(kind="rl", loss=losses.LossConfig(name="grpo"), micro_batches=2)
MESH = {"data": 2, "fsdp": 2, "tensor": 2}
DIGITS = np.arange(3, 13)  # char tokenizer: ids 3..12 are '0'..'9'


def _sampler(mesh):
    net = model.Transformer(CFG)
    b, t = G * N, PROMPT + GEN

    @jax.jit
    def sample(params, key, prompts):  # prompts [B, PROMPT] -> tokens [B, t], logp [B, t-1]
        buf = jnp.concatenate([prompts, jnp.zeros((b, GEN), jnp.int32)], axis=1)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        seg = jnp.ones((b, t), jnp.int32)  # causal: the not-yet-sampled tail is never seen

        def body(i, carry):
            buf, logp = carry
            logits = net.apply({"params": params}, buf, pos, seg)  # [B, t, V]
            cur = PROMPT - 1 + i
            lg = jax.lax.dynamic_index_in_dim(logits, cur, axis=1, keepdims=False)  # [B, V]
            # Never pad/bos/eos, so rows keep a fixed length; the recorded log-prob is the
            # policy's own (unmasked), as an inference engine reports it.
            key_i = jax.random.fold_in(key, i)
            tok = jax.random.categorical(key_i, lg.at[:, :3].set(-1e9))  # [B]
            lp = jnp.take_along_axis(jax.nn.log_softmax(lg), tok[:, None], axis=1)[:, 0]
            return buf.at[:, cur + 1].set(tok), logp.at[:, cur].set(lp)

        return jax.lax.fori_loop(0, GEN, body, (buf, jnp.zeros((b, t - 1), jnp.float32)))

    def rollout(state, published):
        """One batch for learner step `state.step`, sampled by the previous published version
        (staleness 1, as an asynchronous worker would), scored and turned into a Batch."""
        step = int(state.step)
        published[step] = jax.device_get(state.params)  # the weight store keeps versions
        version = max(step - 1, 0)
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), step)
        prompts = np.random.default_rng(step).integers(3, 60, (G, PROMPT))
        prompts = np.repeat(prompts, N, axis=0).astype(np.int32)  # n samples per prompt
        with sharding.use_mesh(mesh):
            tokens, logp = jax.device_get(sample(published[version], key, prompts))
        reward = np.isin(tokens[:, PROMPT:], DIGITS).mean(axis=1)  # [B] share of digits
        adv, seq_mask = advantages.compute_advantages(
            reward.reshape(G, N), advantages.AdvantageConfig()
        )
        loss_mask = np.zeros_like(tokens, np.float32)
        loss_mask[:, PROMPT:] = 1.0
        batch = train_step.make_batch(
            tokens,
            loss_mask,
            valid=np.ones_like(tokens, bool),
            behavior_logp=logp,
            advantages=np.asarray(adv),
            seq_mask=np.asarray(seq_mask),
            on_policy=np.full(G * N, float(version == step)),
        )
        return batch, version

    return rollout


@pytest.fixture(scope="module")
def setup():
    mesh = sharding.make_mesh(MESH)
    _, shardings = train_state.state_shardings(CFG, OPT, mesh)
    step = train_step.jit_step(CFG, OPT, STEP_CFG, mesh, shardings)
    return mesh, shardings, step, _sampler(mesh)


def train(state, n, setup, published, ckpt=None):
    mesh, _, step, rollout = setup
    out = []
    for _ in range(n):
        batch, version = rollout(state, published)
        state, m = step(state, train_step.put_batch(batch, mesh))
        m = jax.device_get(m)  # scalar metrics (the audit's per-row arrays are not compared)
        out.append({k: float(v) for k, v in m.items() if not k.startswith(train_step.ROWS)})
        if ckpt is not None:
            ckpt.save(int(state.step), state, {"sampled_version": version})
    return state, out


def fresh(mesh):
    return train_state.create_train_state(CFG, OPT, mesh, seed=7)


def test_kill_and_resume_matches_uninterrupted_run(setup, tmp_path):
    mesh, shardings, _, _ = setup
    full_state, full = train(fresh(mesh), 5, setup, {})
    assert len({round(m["loss"], 6) for m in full[1:]}) == 4  # stale data: nonzero losses
    # Step 0 samples with the learner's own version: only float noise between the two.
    assert full[0]["mismatch/tokens"] == G * N * GEN and full[0]["mismatch/kl"] < 1e-5

    # Run with checkpoints every 2 steps; "killed" after step 3 (step 3 is never saved).
    ckpt = checkpoint.Checkpointer(str(tmp_path), checkpoint.CheckpointConfig(interval=2, keep=2))
    store = {}  # published versions outlive the learner process (the weight store)
    train(fresh(mesh), 3, setup, store, ckpt)
    ckpt.wait_until_finished()
    del ckpt

    # A new manager on the same directory, restoring into abstract targets (no live state).
    ckpt = checkpoint.Checkpointer(str(tmp_path), checkpoint.CheckpointConfig(interval=2, keep=2))
    assert ckpt.latest_step() == 2
    abstract, _ = train_state.state_shardings(CFG, OPT, mesh)
    state, cursor = ckpt.restore(abstract)
    assert cursor == {"sampled_version": 0} and int(state.step) == 2  # step 1 used v0
    for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True):
        assert x.sharding.is_equivalent_to(s, x.ndim)
    state, resumed = train(state, 3, setup, store, ckpt)
    ckpt.close()

    for a, b in zip(resumed, full[2:], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(full_state), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6, rtol=0)
    assert checkpoint.Checkpointer(str(tmp_path)).all_steps() == [2, 4]  # every 2 steps


def test_restore_onto_another_mesh_and_bad_cursor(setup, tmp_path):
    mesh, _, _, _ = setup
    state = fresh(mesh)
    with checkpoint.Checkpointer(str(tmp_path), checkpoint.CheckpointConfig(interval=1)) as ckpt:
        with pytest.raises(TypeError):
            ckpt.save(1, state, {"not json": object()})
        assert ckpt.save(3, state, {"controller": {"next_prompt": 17}})
        assert not ckpt.save(3, state)  # interval 1 but step 3 exists: not saved again

    one = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    abstract, _ = train_state.state_shardings(CFG, OPT, one)
    with checkpoint.Checkpointer(str(tmp_path)) as ckpt:
        assert ckpt.all_steps() == [3]  # the rejected save left nothing behind
        restored, cursor = ckpt.restore(abstract)
    assert cursor == {"controller": {"next_prompt": 17}}
    for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert x.sharding.device_set == set(jax.devices()[:1])
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    json.dumps(cursor)


def test_restore_without_checkpoint_fails(tmp_path):
    with pytest.raises(FileNotFoundError):
        checkpoint.Checkpointer(str(tmp_path)).restore({})
