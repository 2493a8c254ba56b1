"""Multi-turn episodes in the learner: environment tokens (completion_mask 0) are context,
never actions. The batch puts them in the row but not in the loss mask, and for every
registered loss neither the loss nor its gradient moves when anything at an environment
position changes (the learner's log-prob there, the worker's behaviour log-prob), while
the same change at a model token does move them. One full jitted train step agrees: its
update is the same whatever the environment tokens' behaviour log-probs are."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bridge.control.protocol import ConsumedGroup, Trajectory
from learner_jax.training import advantages, losses, rollout_batch, train_step

P, A, N = 4, 12, 4
# Model turn, observation, model turn: 1 1 | 0 0 0 | 1 (and a single-turn row).
MASKS = ([1, 1, 0, 0, 0, 1], [1, 1, 1], [1, 0, 0, 1, 1], None)


def _groups(rewards=(1.0, 0.0, -1.0, 0.5), env_logp=0.0):
    rng = np.random.default_rng(0)
    trajs = []
    for s, mask in enumerate(MASKS):
        n = len(mask) if mask else 3
        ids = rng.integers(3, 60, n).tolist()
        lps = [float(x) for x in -rng.uniform(0.1, 2.0, n)]
        if mask:
            lps = [lp if m else env_logp for lp, m in zip(lps, mask, strict=True)]
        trajs.append(
            Trajectory(
                prompt_id="p",
                sample_index=s,
                prompt_token_ids=[1, 5, 6],
                completion_token_ids=ids,
                logprobs=lps,
                versions=[3] * n,
                finish_reason="stop",
                completion_mask=mask,
                reward=rewards[s],
            )
        )
    return [ConsumedGroup(group_id=0, prompt_id="p", prompt="x", answer="1", trajectories=trajs)]


def _batch(**kw):
    batch, stats = rollout_batch.groups_to_batch(
        _groups(**kw), N, P, A, current_version=3, adv_cfg=advantages.AdvantageConfig()
    )
    return batch, stats


def test_environment_tokens_are_in_the_row_but_not_in_the_loss_mask():
    batch, stats = _batch()
    assert stats["reward/mean"] == pytest.approx(np.mean([1.0, 0.0, -1.0, 0.5]))
    for row, mask in enumerate(MASKS):
        n = len(mask) if mask else 3
        # target t predicts token t + 1: completion token j is target 3 + j - 1 (prompt 3)
        got = batch.loss_mask[row, 2 : 2 + n].tolist()
        assert got == [float(m) for m in (mask or [1] * n)], row
        assert batch.loss_mask[row].sum() == sum(mask or [1] * n)
        assert (batch.segment_ids[row, : 3 + n - 1] == 1).all()  # env tokens are context


def _inputs(batch, logp):
    return losses.LossInputs(
        prox_logp=jax.lax.stop_gradient(logp),
        behavior_logp=jnp.asarray(batch.behavior_logp),
        advantages=jnp.asarray(batch.advantages),
        loss_mask=jnp.asarray(batch.loss_mask),
        seq_mask=jnp.asarray(batch.seq_mask),
    )


@pytest.mark.parametrize("name", losses.available_losses())
def test_changes_at_environment_tokens_change_neither_loss_nor_gradient(name):
    batch, _ = _batch()
    cfg = losses.LossConfig(name=name, clip_eps=0.2)
    lm = np.asarray(batch.loss_mask)
    rng = np.random.default_rng(1)
    base = jnp.asarray(-rng.uniform(0.1, 2.0, lm.shape), jnp.float32)
    # The learner's log-probs drift from the proximal ones (a second update's view), so the
    # ratio, the clip and the importance weight are all live.
    prox = base + jnp.asarray(rng.normal(0, 0.3, lm.shape), jnp.float32)

    def loss_and_grad(logp, behavior):
        inputs = _inputs(batch, prox)
        inputs = losses.LossInputs(**{**inputs.__dict__, "behavior_logp": behavior})
        fn = lambda lp: losses.compute_loss(lp, inputs, cfg)[0]  # noqa: E731
        return jax.value_and_grad(fn)(logp)

    behavior = jnp.asarray(batch.behavior_logp)
    loss0, grad0 = loss_and_grad(base, behavior)
    env = (lm == 0) & (np.asarray(batch.segment_ids) == 1)  # environment (and prompt) tokens
    assert env.any()
    noise = jnp.asarray(rng.normal(0, 3.0, lm.shape), jnp.float32)
    loss1, grad1 = loss_and_grad(base + noise * env, behavior - jnp.abs(noise) * env)
    np.testing.assert_allclose(loss1, loss0, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(grad1, grad0, rtol=1e-6, atol=1e-7)
    assert float(jnp.abs(grad0 * env).max()) == 0.0  # no gradient flows to a masked token

    model_tok = lm > 0
    loss2, grad2 = loss_and_grad(base + noise * model_tok, behavior)
    assert abs(float(loss2) - float(loss0)) > 1e-4
    assert float(jnp.abs(grad2 - grad0).max()) > 1e-4


def test_a_train_step_ignores_environment_behaviour_logprobs(tiny_model_dir):
    from bridge.model.config import ModelConfig
    from learner_jax.model import sharding
    from learner_jax.training import train_state

    cfg = ModelConfig.from_hf_dir(tiny_model_dir)
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    opt = optax.sgd(0.1)
    step = jax.jit(train_step.make_step_fn(cfg, opt, train_step.StepConfig()))

    def run(batch):
        state = train_state.create_train_state(cfg, opt, mesh)
        with sharding.use_mesh(mesh):
            new, metrics = step(state, batch)
        return new.params, metrics

    a, _ = _batch()
    b, _ = _batch(env_logp=-5.0)  # what a lying worker would put at environment tokens
    assert not np.array_equal(a.behavior_logp, b.behavior_logp)
    pa, ma = run(a)
    pb, mb = run(b)
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert float(ma["loss"]) == float(mb["loss"])
    assert float(ma["tokens"]) == sum(sum(m or [1] * 3) for m in MASKS)
