"""Controller groups -> learner Batch: the worker's log-probs (here computed by
transformers, as a worker's engine would) land on the positions where the learner's Flax
forward scores the same tokens; GRPO advantages match numpy; on-policy flags and
staleness counts are right; rows that do not fit are refused."""

import jax
import numpy as np
import pytest

from bridge.control.protocol import ConsumedGroup, Trajectory
from bridge.model import tiny_model
from learner_jax.model import hf_import, model, sharding
from learner_jax.training import advantages, rollout_batch

P, A, N = 6, 5, 4


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    cfg, params = hf_import.load_hf_params(tiny_model_dir, mesh)

    def hf_logps(ids):
        """log p(ids[j] | ids[:j]) for j >= 1 from one unpadded transformers forward."""
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        return lp.numpy()

    return cfg, params, hf_logps


def make_groups(logps, rng, versions=(7, 7, 6)):
    groups = []
    for g, version in enumerate(versions):
        prompt = [tiny_model.BOS_ID] + rng.integers(3, 60, rng.integers(2, P)).tolist()
        trajs = []
        for s in range(N):
            comp = rng.integers(3, 60, rng.integers(1, A + 1)).tolist()
            lps = logps(prompt + comp)[len(prompt) - 1 :]
            trajs.append(
                Trajectory(
                    prompt_id=f"p{g}",
                    sample_index=s,
                    prompt_token_ids=prompt,
                    completion_token_ids=comp,
                    logprobs=lps.tolist(),
                    versions=[version] * len(comp),
                    reward=float(rng.integers(0, 2)),
                    finish_reason="length",
                )
            )
        rng.shuffle(trajs)  # the learner must not depend on submission order
        groups.append(
            ConsumedGroup(group_id=g, prompt_id=f"p{g}", prompt="x", answer="1", trajectories=trajs)
        )
    return groups


def test_behavior_logps_align_with_learner_positions(models):
    cfg_model, params, hf_logps = models
    groups = make_groups(hf_logps, np.random.default_rng(0))
    cfg = advantages.AdvantageConfig()
    batch, stats = rollout_batch.groups_to_batch(groups, N, P, A, 7, cfg)
    assert batch.tokens.shape == (len(groups) * N, P + A)
    # The batched, right-padded forward scores each target where the behavior log-prob sits.
    lp = np.asarray(
        model.forward_logprobs(
            params, cfg_model, batch.tokens, batch.positions, batch.segment_ids, batch.targets
        )
    )
    m = batch.loss_mask
    np.testing.assert_allclose(lp * m, batch.behavior_logp * m, atol=1e-4)
    assert np.all(batch.behavior_logp[m == 0] == 0)
    # loss tokens = completion tokens
    lengths = [len(t.completion_token_ids) for g in groups for t in g.trajectories]
    assert m.sum() == sum(lengths)
    # advantages: numpy GRPO on rewards in sample order
    rewards = np.array(
        [[t.reward for t in sorted(g.trajectories, key=lambda t: t.sample_index)] for g in groups]
    )
    mean, std = rewards.mean(1, keepdims=True), rewards.std(1, keepdims=True)
    np.testing.assert_allclose(
        batch.advantages, ((rewards - mean) / (std + 1e-6)).reshape(-1), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_array_equal(batch.on_policy, np.repeat([1.0, 1.0, 0.0], N))
    assert stats["staleness/lag_0"] == 2 * N and stats["staleness/lag_1"] == N
    assert stats["reward/mean"] == pytest.approx(rewards.mean())


def test_refuses_rows_that_do_not_fit():
    groups = make_groups(lambda ids: -np.ones(len(ids) - 1), np.random.default_rng(1))
    with pytest.raises(ValueError, match="exceed"):
        rollout_batch.groups_to_batch(groups, N, P, 1, 7, advantages.AdvantageConfig())
    with pytest.raises(ValueError, match="trajectories, expected"):
        rollout_batch.groups_to_batch(groups, N + 1, P, A, 7, advantages.AdvantageConfig())
