"""Temperature below 1 is on-policy end to end: real vLLM samples the tiny Qwen3 at T = 0.7
through the worker's lease path (`generate_groups`, processed log-probs), the controller's
groups become a learner batch, and the learner's log-probs at the same version (fp32,
logits / T) match the worker's within 1e-3, so the RL step's importance weights are 1 and
mismatch/kl is ~0. Scoring the same tokens at temperature 1 (what both sides did before)
misses by far more, which shows the check can fail."""

import jax
import numpy as np
import pytest

from bridge.control.protocol import ConsumedGroup, PromptGroup, SamplingParams, Trajectory
from bridge.model import tiny_model
from learner_jax.model import hf_import, model, sharding
from learner_jax.training import advantages, losses, optim, rollout_batch, train_state, train_step
from rollout_gpu.generate import generate_groups

pytestmark = pytest.mark.vllm

T_SAMPLE, N, P, A = 0.7, 4, 8, 24


@pytest.fixture(scope="module")
def sampled(vllm_engine):
    """Three leased groups sampled by the session engine at T = 0.7, as consumed groups."""
    rng = np.random.default_rng(0)
    sampling = SamplingParams(temperature=T_SAMPLE, max_tokens=A, stop_token_ids=[])
    leased = [
        PromptGroup(
            group_id=g,
            prompt_id=f"p{g}",
            task="t",
            prompt="x",
            prompt_token_ids=[tiny_model.BOS_ID] + rng.integers(3, 60, 5).tolist(),
            n=N,
            sampling=sampling,
        )
        for g in range(3)
    ]
    results = generate_groups(vllm_engine, leased, version=0)
    groups = []
    for lease, result in zip(leased, results, strict=True):
        trajs = [
            Trajectory(**t.model_dump(), reward=float(t.sample_index % 2))
            for t in result.trajectories
        ]
        groups.append(
            ConsumedGroup(
                group_id=lease.group_id, prompt_id=lease.prompt_id, prompt="x", answer="1",
                trajectories=trajs,
            )
        )  # fmt: skip
    batch, _ = rollout_batch.groups_to_batch(groups, N, P, A, 0, advantages.AdvantageConfig())
    return batch


@pytest.fixture(scope="module")
def learner(tiny_model_dir):
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    cfg, params = hf_import.load_hf_params(tiny_model_dir, mesh)
    return mesh, cfg, params


def learner_logp(learner, batch, temperature):
    _, cfg, params = learner
    return np.asarray(
        model.forward_logprobs(
            params, cfg, batch.tokens, batch.positions, batch.segment_ids, batch.targets,
            temperature=temperature,
        )
    )  # fmt: skip


def test_learner_matches_worker_at_sampling_temperature(sampled, learner):
    m = sampled.loss_mask > 0
    assert m.sum() >= 3 * N * 10, "expected mostly full-length completions"
    assert np.all(sampled.on_policy == 1.0)
    gap = np.abs(learner_logp(learner, sampled, T_SAMPLE) - sampled.behavior_logp)[m]
    # Temperature-1 scores (the old behaviour) are a different distribution entirely.
    untempered = np.abs(learner_logp(learner, sampled, 1.0) - sampled.behavior_logp)[m]
    print(f"T={T_SAMPLE}: {m.sum()} tokens, |learner - worker| max {gap.max():.2e}; "
          f"scored at T=1: mean {untempered.mean():.3f}")  # fmt: skip
    assert gap.max() <= 1e-3, gap.max()
    assert untempered.mean() > 0.05, untempered.mean()


def test_rl_step_sees_unit_importance_weights(sampled, learner):
    mesh, cfg, params = learner
    opt = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-3, total_steps=2))
    _, shardings = train_state.state_shardings(cfg, opt, mesh)
    state = train_state.state_from_params(cfg, params, opt, mesh, sharding.DEFAULT_RULES, 0)
    step_cfg = train_step.StepConfig(
        kind="rl", loss=losses.LossConfig(name="grpo"), temperature=T_SAMPLE
    )
    step = train_step.jit_step(cfg, opt, step_cfg, mesh, shardings, donate=False)
    _, metrics = step(state, train_step.put_batch(sampled, mesh))
    metrics = jax.device_get(metrics)
    print({k: float(v) for k, v in metrics.items() if "is_weight" in k or "mismatch" in k})
    assert metrics["mismatch/tokens"] == sampled.loss_mask.sum()
    assert metrics["mismatch/kl"] <= 1e-6, metrics["mismatch/kl"]
    for name in ("is_weight/mean", "is_weight/max", "is_weight/min"):
        assert abs(float(metrics[name]) - 1.0) <= 1e-3, (name, metrics[name])
