"""Multi-turn episodes on the real vLLM engine, scored by the real controller, batched by
the learner; and a verl-style reward file end to end to the learner's `reward/mean`.

Hold'em (pokerkit) episodes: the worker's trajectories keep the sampled tokens (their
behaviour log-probs are what vLLM scores for exactly that token history), the
environment tokens are the observations an independent replay produces (transformers'
tokenizer decoding the model turns), the controller's replayed reward equals that
episode's reward (payoffs summing to zero), and the learner's loss mask is the
completion mask.
"""

import os

import numpy as np
import pytest

from bridge.contracts.prompt import TextCodec
from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.protocol import LeaseRequest, SamplingParams, Submission, WorkerProfile
from bridge.tasks import make_env, make_task, replay
from learner_jax.training import advantages, rollout_batch
from rollout_gpu.generate import generate_groups

pytestmark = pytest.mark.vllm
PROFILE = WorkerProfile(accelerator="cpu", price_per_hour=0.0, max_concurrent_sequences=64)


def _controller(tmp_path, model_dir, task, groups, n, **cfg):
    codec = TextCodec(model_dir)
    os.makedirs(tmp_path, exist_ok=True)
    config = ControllerConfig(
        staleness=1,
        groups_per_step=groups,
        group_size=n,
        vocab_size=128,
        max_prompt_tokens=64,
        reward_timeout_s=10.0,  # scored (and replayed) in the reward pool
        **cfg,
    )
    ctl = Controller(config, os.path.join(tmp_path, "controller.db"), task, codec=codec)
    worker_id, _ = ctl.register(PROFILE)
    ctl.publish(0)
    lease = ctl.lease(worker_id, LeaseRequest(worker_version=0, max_groups=groups)).lease
    assert lease is not None and len(lease.groups) == groups
    return ctl, worker_id, lease


def _submit_and_take(ctl, worker_id, lease, results, groups):
    r = ctl.submit(worker_id, Submission(lease_id=lease.lease_id, groups=results))
    assert sorted(r.accepted) == sorted(g.group_id for g in lease.groups)
    batch, stats = ctl.take_batch(0, groups)
    assert batch is not None, stats
    assert stats["reward/errors"] == 0
    return batch


def test_holdem_episodes_on_vllm_are_exact_and_replayed_on_the_trusted_side(
    vllm_engine, tiny_model_dir, tmp_path
):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos = tok.eos_token_id
    # invalid="call": the untrained model stays in the hand, so episodes run several turns.
    task = make_task("holdem", invalid="call", max_turns=6, turn_max_tokens=2)
    sampling = SamplingParams(max_tokens=8, stop_token_ids=[eos])
    ctl, wid, lease = _controller(
        tmp_path, tiny_model_dir, task, 2, 3, sampling=sampling, max_completion_tokens=150
    )
    assert all(g.sampling.max_tokens == 2 and g.episode.env == "holdem" for g in lease.groups)
    # Observations from the controller, turn by turn (the lease hides the seed:
    # it is the deal); the independent replay below takes the seeds from its database.
    from bridge.control.protocol import EpisodeStep

    assert all(g.episode.seed == -1 for g in lease.groups)
    observe = lambda eps: ctl.episode_step(wid, EpisodeStep(lease_id=lease.lease_id, episodes=eps))
    results = generate_groups(vllm_engine, lease.groups, version=0, observe=observe)
    seeds = {r["group_id"]: int(r["answer"]) for r in ctl.db.groups_in("leased")}

    worker_rewards, turns = {}, []
    for group, result in zip(lease.groups, results, strict=True):
        for t in result.trajectories:
            mask = t.completion_mask
            assert len(mask) == len(t.completion_token_ids) == len(t.logprobs)
            segs = t.segments()
            assert segs[0][0] == 1 and segs[-1][0] == 1
            actions = [tok.decode(ids, skip_special_tokens=True) for m, ids in segs if m == 1]
            turns.append(len(actions))
            ep = replay(make_env("holdem", invalid="call"), seeds[group.group_id], actions)
            shown = [tok.decode(ids) for m, ids in segs if m == 0]
            assert shown == ep.observations[: len(shown)]  # the environment's own words
            assert (t.finish_reason == "stop") == ep.done
            if ep.done:
                env = make_env("holdem", invalid="call")
                replay(env, seeds[group.group_id], actions)
                assert sum(env.payoffs) == 0 and ep.reward == env.payoffs[env.seat]
            worker_rewards[(result.group_id, t.sample_index)] = ep.reward
            # The model's tokens are exactly as sampled: vLLM scores the same log-probs for
            # them given the whole episode so far (prompt, earlier turns, observations).
            full = list(t.prompt_token_ids) + list(t.completion_token_ids)
            ref = vllm_engine.prompt_logprobs([full])[0][len(t.prompt_token_ids) - 1 :]
            model = np.asarray(mask) == 1
            np.testing.assert_allclose(np.asarray(t.logprobs)[model], ref[model], atol=2e-3)
            assert all(x == 0.0 for x, m in zip(t.logprobs, mask, strict=True) if m == 0)
    assert max(turns) >= 2, turns  # really multi-turn

    batch = _submit_and_take(ctl, wid, lease, results, 2)
    for g in batch:
        for t in g.trajectories:
            assert t.reward == worker_rewards[(g.group_id, t.sample_index)]
    b, stats = rollout_batch.groups_to_batch(
        batch, 3, 64, 150, current_version=0, adv_cfg=advantages.AdvantageConfig()
    )
    rows = [t for g in batch for t in sorted(g.trajectories, key=lambda t: t.sample_index)]
    for r, t in enumerate(rows):
        p = len(t.prompt_token_ids)
        np.testing.assert_array_equal(
            b.loss_mask[r, p - 1 : p - 1 + len(t.completion_token_ids)], t.completion_mask
        )
    assert stats["reward/mean"] == pytest.approx(np.mean(list(worker_rewards.values())))
    ctl.close()


REWARD_FILE = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's convention; a deterministic, non-binary score of the text."""
    assert data_source == "arithmetic"
    right = 1.0 if solution_str.strip() == ground_truth else 0.0
    return {"score": right + 0.125 * (len(solution_str) % 4), "right": right}
'''


def test_a_reward_file_loaded_by_path_is_what_reward_mean_reports(
    vllm_engine, tiny_model_dir, tmp_path
):
    import importlib.util

    from transformers import AutoTokenizer

    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    spec = importlib.util.spec_from_file_location("my_reward_here", path)
    mine = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mine)

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    task = make_task("arithmetic", reward_fn=f"{path}:compute_score")
    sampling = SamplingParams(max_tokens=6, stop_token_ids=[tok.eos_token_id])

    def reference(ids, answer):
        # A completion with a special or padded-vocab id before its final stop scores 0 by
        # the trusted side's hidden-token rule (bridge/control/intake/rewards.py), before any
        # reward runs.
        stops = (tok.eos_token_id, tok.pad_token_id)  # one final stop may end it
        body = ids[:-1] if ids and ids[-1] in stops else ids
        if any(i >= len(tok) or i in tok.all_special_ids for i in body):
            return 0.0
        return mine.compute_score("arithmetic", tok.decode(body), answer)["score"]

    # Each lease's sampling seed is fresh and secret, so its 16 samples can, rarely, all score
    # the same; the equality below means something only when the scores vary, so a run that
    # drew equal scores draws another lease (each is an independent chance).
    for attempt in range(4):
        ctl, wid, lease = _controller(
            tmp_path / str(attempt), tiny_model_dir, task, 4, 4, sampling=sampling
        )
        results = generate_groups(vllm_engine, lease.groups, version=0)
        batch = _submit_and_take(ctl, wid, lease, results, 4)
        _, stats = rollout_batch.groups_to_batch(
            batch, 4, 64, 6, current_version=0, adv_cfg=advantages.AdvantageConfig()
        )
        # The user's function, called here on the completion text decoded independently,
        # with the task's reference answer (which only the trusted side holds).
        answers = {g.group_id: g.answer for g in batch}
        expected = [
            reference(list(t.completion_token_ids), answers[g.group_id])
            for g in batch
            for t in g.trajectories
        ]
        if len(set(expected)) > 1:
            break
        ctl.close()
    assert len(set(expected)) > 1, "four leases in a row scored every sample alike"
    assert stats["reward/mean"] == pytest.approx(float(np.mean(expected)), abs=1e-6)
    ctl.close()
