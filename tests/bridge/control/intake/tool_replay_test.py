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
from bridge.model import qwen3_tokenizer
from bridge.model.tiny_model import EOS_ID
from bridge.tasks import make_env, make_task
from bridge.tasks.tool_arith import call_text
from bridge.tasks.tool_draw import DRAW_CALL

PROFILE = WorkerProfile(accelerator="cpu", price_per_hour=0.0, max_concurrent_sequences=64)


def _lease(tmp_path, model_dir, n=2, task=None, vocab_size=128, prompt_tokens=16, stop=EOS_ID):
    task = task or make_task("tool_arith")
    config = ControllerConfig(
        staleness=1,
        groups_per_step=1,
        group_size=n,
        vocab_size=vocab_size,
        max_prompt_tokens=prompt_tokens,
        reward_timeout_s=10.0,  # replayed in the reward pool, tools in its sandbox
        sampling=SamplingParams(max_tokens=72, stop_token_ids=[stop]),
        max_completion_tokens=120 if stop == EOS_ID else 640,
    )
    codec = TextCodec(model_dir, task.prompt_format)
    ctl = Controller(config, os.path.join(tmp_path, "c.db"), task, codec=codec)
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
    honest = [_episode(codec, group, i) for i in range(2)]
    _forged_refused_honest_rewarded(ctl, wid, lease, group, forged, honest)


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


def test_a_nondeterministic_tool_is_scored_from_what_the_controller_drew(tmp_path):
    """tool_draw's tool returns a fresh random number per call: no replay can recompute
    it. The lease carries no seed; the controller draws when it answers each call (POST
    /v1/episode) and scores from what it drew; an observation other than the one it
    answered is refused. In Qwen3's chat format, with one episode's first turn cut by the
    token budget: the controller's answer to it starts with the <|im_end|> that closes it."""
    path = str(tmp_path / "qwen3_tok")
    qwen3_tokenizer.save_qwen3_tokenizer(path)
    task = make_task("tool_draw", turns="qwen3")
    codec = TextCodec(path, task.prompt_format)
    im_end = qwen3_tokenizer.token_id("<|im_end|>")
    ctl, wid, lease = _lease(tmp_path, path, task=task, vocab_size=272, prompt_tokens=1024,
                             stop=im_end)  # fmt: skip
    (group,) = lease.groups
    assert group.episode.seed == -1  # controller mode: the worker cannot run the tool
    addend = int(codec.decode(group.prompt_token_ids).split("draw+")[1].split("=")[0])
    eot = codec.encode("<|im_end|>")
    call, cut = codec.encode(DRAW_CALL) + eot, codec.encode(DRAW_CALL[:20])  # no <|im_end|>
    # The scripted worker: episode 0 calls then answers; episode 1's first call is cut.
    turns, shown = [[call], [cut]], [[], []]
    for _ in range(3):
        live = [i for i in (0, 1) if len(turns[i]) > len(shown[i])]
        req = EpisodeStep(lease_id=lease.lease_id, episodes=[
            EpisodeTurns(group_id=group.group_id, sample_index=i, turns=turns[i]) for i in live
        ])  # fmt: skip
        for i, o in zip(live, ctl.episode_step(wid, req).observations, strict=True):
            shown[i].append(o.observation)
            if o.done:
                continue
            draw = o.observation.split("<tool_response>\n")[1].split("\n")[0]
            turns[i].append(call if draw.startswith("error") else
                            codec.encode(str(int(draw) + addend)) + eot)  # fmt: skip
    assert [len(t) for t in turns] == [2, 3]
    assert shown[1][0].startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\nerror")
    assert not shown[0][0].startswith("<|im_end|>")

    def episode(index, shift=0):
        """The played turns and the controller's observations, a draw + `shift`."""
        ids, mask = [], []
        for k, turn in enumerate(turns[index]):
            ids, mask = ids + turn, mask + [1] * len(turn)
            if k < len(turns[index]) - 1:
                obs = shown[index][k]
                if k == len(turns[index]) - 2 and shift:
                    draw = int(obs.split("<tool_response>\n")[1].split("\n")[0])
                    obs = obs.replace(f"\n{draw}\n", f"\n{draw + shift}\n")
                ids, mask = ids + codec.encode(obs), mask + [0] * len(codec.encode(obs))
        return WorkerTrajectory(
            prompt_id=group.prompt_id, sample_index=index,
            prompt_token_ids=list(group.prompt_token_ids), completion_token_ids=ids,
            logprobs=[-1.0 if m else 0.0 for m in mask], versions=[0] * len(ids),
            finish_reason="stop", completion_mask=mask,
        )  # fmt: skip

    forged = [episode(0), episode(1, shift=1)]  # a draw the controller never made
    # Drawing again would disagree with the controller's answers (1 in 100 per episode);
    # the honest episodes are scored from the recorded draws and get full reward.
    _forged_refused_honest_rewarded(ctl, wid, lease, group, forged, [episode(0), episode(1)])


def _forged_refused_honest_rewarded(ctl, wid, lease, group, forged, honest):
    """The forged group is refused (422, nothing accepted); the honest one is accepted and
    both its episodes get full reward."""
    with pytest.raises(SubmissionError, match="differ from the replay") as e:
        ctl.submit(wid, Submission(lease_id=lease.lease_id, groups=[
            GroupResult(group_id=group.group_id, trajectories=forged)]))  # fmt: skip
    assert e.value.status == 422
    r = ctl.submit(wid, Submission(lease_id=lease.lease_id, groups=[
        GroupResult(group_id=group.group_id, trajectories=honest)]))  # fmt: skip
    assert r.accepted == [group.group_id]
    batch, stats = ctl.take_batch(0, 1)
    assert [t.reward for t in batch[0].trajectories] == [1.0, 1.0], stats
    ctl.close()
