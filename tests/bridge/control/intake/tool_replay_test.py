"""Trust for tool episodes, through the real controller: a tool task's lease carries the
seed (the question hides nothing; the worker runs the tools in its own sandbox), and the
controller replays every episode from the model's turns, recomputing each tool result in
its sandbox. A worker that fabricates a tool result is refused (422); the honest episode
scores 1. The same lease played by the real vLLM worker code is accepted."""

import os

import pytest

from bridge.contracts.prompt import TextCodec
from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.intake.validation import SubmissionError
from bridge.control.protocol import (
    GroupResult,
    LeaseRequest,
    SamplingParams,
    Submission,
    WorkerProfile,
    WorkerTrajectory,
)
from bridge.model.tiny_model import EOS_ID
from bridge.tasks import make_env, make_task
from bridge.tasks.tool_arith import call_text

PROFILE = WorkerProfile(accelerator="cpu", price_per_hour=0.0, max_concurrent_sequences=64)


def _lease(tmp_path, model_dir, n=2):
    task = make_task("tool_arith")
    config = ControllerConfig(
        staleness=1,
        groups_per_step=1,
        group_size=n,
        vocab_size=128,
        max_prompt_tokens=16,
        reward_timeout_s=10.0,  # replayed in the reward pool, tools in its sandbox
        sampling=SamplingParams(max_tokens=72, stop_token_ids=[EOS_ID]),
        max_completion_tokens=120,
    )
    ctl = Controller(config, os.path.join(tmp_path, "c.db"), task, codec=TextCodec(model_dir))
    wid, _ = ctl.register(PROFILE)
    ctl.publish(0)
    lease = ctl.lease(wid, LeaseRequest(worker_version=0, max_groups=1)).lease
    return ctl, wid, lease


def _episode(codec, group, index, result_shift=0):
    """A worker's trajectory: the call, the tool result (+ `result_shift`: made up), then
    the answer the result implies."""
    env = make_env("tool_arith")
    question = env.reset(group.episode.seed)
    a, b = (int(x) for x in question.rstrip("=").split("*"))
    call = codec.encode(call_text(f"{a}*{b}")) + [EOS_ID]
    obs, _, done = env.step(call_text(f"{a}*{b}"))
    assert not done and f"\n{a * b}\n" in obs
    obs = codec.encode(obs.replace(str(a * b), str(a * b + result_shift)))
    answer = codec.encode(str(a * b + result_shift)) + [EOS_ID]
    ids = call + obs + answer
    return WorkerTrajectory(
        prompt_id=group.prompt_id,
        sample_index=index,
        prompt_token_ids=list(group.prompt_token_ids),
        completion_token_ids=ids,
        logprobs=[-1.0 if m else 0.0 for m in [1] * len(call) + [0] * len(obs) + [1] * len(answer)],
        versions=[0] * len(ids),
        finish_reason="stop",
        completion_mask=[1] * len(call) + [0] * len(obs) + [1] * len(answer),
    )


def test_a_fabricated_tool_result_is_refused_and_the_honest_episode_scores(
    tmp_path, tiny_model_dir
):
    ctl, wid, lease = _lease(tmp_path, tiny_model_dir)
    (group,) = lease.groups
    assert group.episode.env == "tool_arith" and group.episode.seed >= 0  # the worker plays
    codec = TextCodec(tiny_model_dir)
    forged = [_episode(codec, group, 0), _episode(codec, group, 1, result_shift=1)]
    with pytest.raises(SubmissionError, match="differ from the replay") as e:
        ctl.submit(wid, Submission(lease_id=lease.lease_id, groups=[
            GroupResult(group_id=group.group_id, trajectories=forged)]))  # fmt: skip
    assert e.value.status == 422
    honest = [_episode(codec, group, i) for i in range(2)]
    r = ctl.submit(wid, Submission(lease_id=lease.lease_id, groups=[
        GroupResult(group_id=group.group_id, trajectories=honest)]))  # fmt: skip
    assert r.accepted == [group.group_id]
    batch, stats = ctl.take_batch(0, 1)
    assert [t.reward for t in batch[0].trajectories] == [1.0, 1.0], stats
    ctl.close()


@pytest.mark.vllm
def test_a_tool_lease_played_by_the_vllm_worker_is_replayed_and_accepted(
    tmp_path, tiny_model_dir, vllm_engine
):
    from rollout_gpu.generate import generate_groups

    ctl, wid, lease = _lease(tmp_path, tiny_model_dir, n=4)
    results = generate_groups(vllm_engine, lease.groups, version=0)
    r = ctl.submit(wid, Submission(lease_id=lease.lease_id, groups=results))
    assert r.accepted == [lease.groups[0].group_id]
    batch, stats = ctl.take_batch(0, 1)
    assert batch is not None and stats["reward/errors"] == 0
    ctl.close()
