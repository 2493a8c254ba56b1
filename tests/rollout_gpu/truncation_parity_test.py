"""Top-p, top-k and min-p are on-policy end to end: real vLLM samples the tiny Qwen3 through
the worker's lease path (`generate_groups`, `processed_logprobs`) with each setting at
T = 0.7, and the learner's log-probs of those tokens at the same version under the same
truncation (learner_jax/model/truncation.py) match the worker's within 1e-3. Scoring the same
tokens under the untruncated tempered softmax misses by more, which shows the check can
fail (and that the setting reached vLLM)."""

import jax
import numpy as np
import pytest

from bridge.control.protocol import PromptGroup, SamplingParams
from bridge.model import tiny_model
from learner_jax.model import hf_import, model, sharding
from learner_jax.model.truncation import Truncation
from rollout_gpu.generate import generate_groups

pytestmark = pytest.mark.vllm

T_SAMPLE, N, A = 0.7, 4, 24
SETTINGS = [
    Truncation(top_p=0.8),
    Truncation(top_k=5),
    Truncation(min_p=0.3),
    Truncation(top_p=0.9, top_k=8, min_p=0.1),
]


@pytest.fixture(scope="module")
def learner(tiny_model_dir):
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    _, cfg, params = (mesh, *hf_import.load_hf_params(tiny_model_dir, mesh))
    return cfg, params


def sample(engine, t: Truncation):
    """(tokens [R, P + A], worker log-probs [R, A], mask [R, A]) of 2 groups x N samples."""
    rng = np.random.default_rng(0)
    sampling = SamplingParams(
        temperature=T_SAMPLE, top_p=t.top_p, top_k=t.top_k, min_p=t.min_p, max_tokens=A
    )
    leased = [
        PromptGroup(
            group_id=g, prompt_id=f"p{g}", task="t", prompt="x",
            prompt_token_ids=[tiny_model.BOS_ID] + rng.integers(3, 60, 5).tolist(),
            n=N, sampling=sampling,
        )
        for g in range(2)
    ]  # fmt: skip
    rows, behav, mask = [], [], []
    for lease, result in zip(leased, generate_groups(engine, leased, version=0), strict=True):
        for traj in result.trajectories:
            ids, lps = traj.completion_token_ids, traj.logprobs
            pad = A - len(ids)
            rows.append(list(lease.prompt_token_ids) + ids + [0] * pad)
            behav.append(list(lps) + [0.0] * pad)
            mask.append([1.0] * len(ids) + [0.0] * pad)
    return np.asarray(rows), np.asarray(behav), np.asarray(mask) > 0


def learner_logp(learner, rows, t: Truncation):
    """The learner's log-probs of each completion token [R, A]."""
    cfg, params = learner
    tokens, targets = rows[:, :-1], rows[:, 1:]
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    lp = model.forward_logprobs(
        params, cfg, tokens, positions, np.ones_like(tokens), targets,
        temperature=T_SAMPLE, truncation=t,
    )  # fmt: skip
    return np.asarray(lp)[:, -A:]


@pytest.mark.parametrize("t", SETTINGS, ids=str)
def test_learner_matches_worker_under_truncation(vllm_engine, learner, t):
    rows, behav, m = sample(vllm_engine, t)
    assert m.sum() >= 2 * N * 10, "expected mostly full-length completions"
    gap = np.abs(learner_logp(learner, rows, t) - behav)[m]
    full = np.abs(learner_logp(learner, rows, Truncation()) - behav)[m]
    print(f"{t}: {m.sum()} tokens, |learner - worker| max {gap.max():.2e}; "
          f"untruncated: mean {full.mean():.3f}")  # fmt: skip
    assert gap.max() <= 1e-3, gap.max()
    assert full.mean() > 0.02, full.mean()
