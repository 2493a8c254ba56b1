"""Trust for tool episodes, through the real controller: a tool task's lease carries the
seed (the question hides nothing; the worker runs the tools in its own sandbox), and the
controller replays every episode from the model's turns, recomputing each tool result in
its sandbox. A worker that fabricates a tool result is refused (422); the honest episode
scores 1. The same lease played by the real vLLM worker code is accepted. A tool that is
not deterministic runs on the controller (POST /v1/episode), which scores from what it
drew."""

import os

import pytest

from bridge.contracts.prompt import TextCodec
from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.intake.validation import SubmissionError
from bridge.control.protocol import (
    EpisodeStep,
    EpisodeTurns,
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
from bridge.tasks.tool_draw import DRAW_CALL

PROFILE = WorkerProfile(accelerator="cpu", price_per_hour=0.0, max_concurrent_sequences=64)


def _lease(tmp_path, model_dir, n=2, task=None):
    task = task or make_task("tool_arith")
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


def _step(ctl, wid, lease, group, turns):
    """POST /v1/episode through the controller: each episode's model turns so far."""
    req = EpisodeStep(lease_id=lease.lease_id, episodes=[
        EpisodeTurns(group_id=group.group_id, sample_index=i, turns=t) for i, t in enumerate(turns)
    ])  # fmt: skip
    return ctl.episode_step(wid, req).observations


def test_a_nondeterministic_tool_is_scored_from_what_the_controller_drew(
    tmp_path, tiny_model_dir
):
    """tool_draw's tool returns a fresh random number per call: no replay can recompute
    it. The lease carries no seed, the controller draws when it answers each call and
    scores from what it drew; an observation other than the controller's is refused."""
    task = make_task("tool_draw")
    ctl, wid, lease = _lease(tmp_path, tiny_model_dir, task=task)
    (group,) = lease.groups
    assert group.episode.seed == -1  # controller mode: the worker cannot run the tool
    codec = TextCodec(tiny_model_dir)
    addend = int(codec.decode(group.prompt_token_ids).split("+")[1].rstrip("="))
    call = codec.encode(DRAW_CALL) + [EOS_ID]
    first = _step(ctl, wid, lease, group, [[call], [call]])
    assert not any(o.done for o in first)
    draws = [int(o.observation.split("<tool_response>\n")[1].split("\n")[0]) for o in first]

    answers = [codec.encode(str(d + addend)) + [EOS_ID] for d in draws]
    last = _step(ctl, wid, lease, group, [[call, a] for a in answers])
    assert all(o.done for o in last)

    def episode(index, shift=0):
        """The played turns with the controller's observation, its draw + `shift`."""
        obs = codec.encode(first[index].observation.replace(
            f"\n{draws[index]}\n", f"\n{draws[index] + shift}\n"))  # fmt: skip
        answer = answers[index]
        ids, mask = call + obs + answer, [1] * len(call) + [0] * len(obs) + [1] * len(answer)
        return WorkerTrajectory(
            prompt_id=group.prompt_id, sample_index=index,
            prompt_token_ids=list(group.prompt_token_ids), completion_token_ids=ids,
            logprobs=[-1.0 if m else 0.0 for m in mask], versions=[0] * len(ids),
            finish_reason="stop", completion_mask=mask,
        )  # fmt: skip

    forged = [episode(0), episode(1, shift=1)]  # a draw the controller never made
    with pytest.raises(SubmissionError, match="differ from the replay") as e:
        ctl.submit(wid, Submission(lease_id=lease.lease_id, groups=[
            GroupResult(group_id=group.group_id, trajectories=forged)]))  # fmt: skip
    assert e.value.status == 422
    # Drawing again would disagree with the controller's answers (1 in 100 per episode);
    # the honest episodes are scored from the recorded draws and get full reward.
    honest = [episode(0), episode(1)]
    r = ctl.submit(wid, Submission(lease_id=lease.lease_id, groups=[
        GroupResult(group_id=group.group_id, trajectories=honest)]))  # fmt: skip
    assert r.accepted == [group.group_id]
    batch, stats = ctl.take_batch(0, 1)
    assert [t.reward for t in batch[0].trajectories] == [1.0, 1.0], stats
    ctl.close()
