"""verifiers (v1) environments through echo2 (bridge/tasks/verifiers_env.py).

The calculator (multi-turn tool use) played turn by turn through the real controller, as a
worker plays it: the observations are the tool's results in Qwen3's tool-response format, the
reward is the env's `@vf.reward` on the trusted replay, and a submission whose tool result
was fabricated is refused. A TextArena game on the real vLLM engine: the trajectory's model
tokens are exactly the ids the engine sampled, its environment tokens exactly the replay's.
"""

import json
import os

import numpy as np
import pytest

from bridge.contracts.prompt import TextCodec
from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.intake.validation import SubmissionError
from bridge.control.protocol import (
    EpisodeStep,
    EpisodeTurns,
    LeaseRequest,
    SamplingParams,
    Submission,
    WorkerProfile,
    WorkerTrajectory,
)
from bridge.model import qwen3_tokenizer, tiny_model
from bridge.tasks import Prompt, make_env, make_task
from bridge.tasks.chat_turns import cut_turn_close

pytest.importorskip("verifiers")
CALC = "bridge.tasks.verifiers_envs.calculator"
GAME = "bridge.tasks.verifiers_envs.textarena_local"
PROFILE = WorkerProfile(accelerator="cpu", price_per_hour=0.0, max_concurrent_sequences=64)
EOS = qwen3_tokenizer.EOS_TOKEN


@pytest.fixture(scope="module")
def qwen3_dir(qwen3_chat_model_dir):
    return qwen3_chat_model_dir


def _controller(tmp_path, model_dir, task, n, **cfg):
    config = ControllerConfig(
        staleness=1,
        groups_per_step=1,
        group_size=n,
        vocab_size=tiny_model.qwen3_config().vocab_size,  # the model samples its padding ids too
        max_prompt_tokens=1024,
        # A cold reward-pool process imports verifiers on its first replay (seconds of CPU,
        # far more wall time on a loaded machine); warm replays take milliseconds.
        reward_timeout_s=180.0,
        lease_ttl_s=3600.0,  # the test sends no heartbeats
        **cfg,
    )
    ctl = Controller(config, os.path.join(tmp_path, "c.db"), task, codec=TextCodec(model_dir))
    wid, _ = ctl.register(PROFILE)
    ctl.publish(0)
    lease = ctl.lease(wid, LeaseRequest(worker_version=0, max_groups=1)).lease
    assert lease is not None and len(lease.groups) == 1
    return ctl, wid, lease


def _call(expression: str) -> str:
    body = json.dumps({"name": "calculate", "arguments": {"expression": expression}})
    return f"<tool_call>\n{body}\n</tool_call>"


def test_a_turn_is_parsed_into_verifiers_messages_and_malformed_calls_are_observations():
    env = make_env("verifiers", verifiers_env=CALC)
    env.reset(3)
    task = env._episode.task
    obs, reward, done = env.step("<think>use the tool</think>" + _call(task.data.expression))
    assert obs.startswith(f"\n<|im_start|>user\n<tool_response>\n{task.data.answer}\n")
    obs, _, done = env.step('<tool_call>{"name": "calculate"</tool_call> <tool_call>{"x"')
    assert not done and obs.count("error: malformed tool call") == 2
    obs, reward, done = env.step(f"It is {task.data.answer}.")
    assert (reward, done) == (1.0, True)
    calls, results = [], []
    for n in env._episode.trace.nodes:
        m = n.message
        if m.role == "assistant":
            calls.append((m.reasoning_content, m.content, [c.name for c in m.tool_calls or []]))
        if m.role == "tool":
            results.append(m.content)
    assert calls == [
        ("use the tool", "", ["calculate"]),
        (None, "", []),
        (None, f"It is {task.data.answer}.", []),
    ]
    assert results[0] == str(task.data.answer) and len(results) == 3


def test_tool_episode_through_the_controller_scored_by_the_rubric_on_the_trusted_side(
    qwen3_dir, tmp_path
):
    codec = TextCodec(qwen3_dir)
    task = make_task("verifiers", verifiers_env=CALC, max_turns=3, turn_max_tokens=256)
    sampling = SamplingParams(max_tokens=256)
    ctl, wid, lease = _controller(
        tmp_path, qwen3_dir, task, 3, max_completion_tokens=1024, sampling=sampling
    )
    group = lease.groups[0]
    assert group.episode.seed == -1  # the task (and its answer) stays on the controller
    # The trusted side's own view of the episode (the test reads the answer the worker
    # never sees, to write a right and a wrong final turn).
    seed = int(next(r["answer"] for r in ctl.db.groups_in("leased")))
    env = make_env("verifiers", verifiers_env=CALC)
    env.reset(seed)
    answer = env._episode.task.data.answer
    expression = env._episode.task.data.expression

    plays = {  # sample index -> model turns (text, each closed by the sampled <|im_end|>)
        0: [_call(expression), f"The answer is {answer}"],  # right: reward 1
        1: ["<tool_call>{not json</tool_call>", f"{answer + 1}"],  # malformed call, wrong
        2: [_call(expression), f"The answer is {answer}"],  # its tool result forged below
    }
    trajectories, forged = {}, None
    for i, turns in plays.items():
        ids = [codec.encode(t + EOS) for t in turns]
        completion, mask, fake = [], [], []
        for k in range(len(ids)):
            played = EpisodeTurns(group_id=group.group_id, sample_index=i, turns=ids[: k + 1])
            step = EpisodeStep(lease_id=lease.lease_id, episodes=[played])
            obs = ctl.episode_step(wid, step).observations[0]
            completion, fake, mask = completion + ids[k], fake + ids[k], mask + [1] * len(ids[k])
            if obs.done:
                break
            if i == 0:  # the tool really ran on the controller: its result, Qwen3-formatted
                head = f"\n<|im_start|>user\n<tool_response>\n{answer}\n"
                assert obs.observation.startswith(head)
            if i == 1:
                assert "malformed tool call" in obs.observation  # an observation, no crash
            shown = codec.encode(obs.observation)
            # A worker claiming the tool said something else: the value's last digit changed.
            other = str(answer)[:-1] + str((int(str(answer)[-1]) + 1) % 10)
            lie = codec.encode(obs.observation.replace(f"\n{answer}\n", f"\n{other}\n"))
            completion, fake, mask = completion + shown, fake + lie, mask + [0] * len(shown)
        assert obs.done
        trajectories[i] = _trajectory(group, i, completion, mask)
        if i == 2:
            forged = _trajectory(group, i, fake, mask)
            assert forged.completion_token_ids != trajectories[i].completion_token_ids

    from bridge.control.protocol import GroupResult

    def submit(samples):
        result = GroupResult(group_id=group.group_id, trajectories=samples)
        return ctl.submit(wid, Submission(lease_id=lease.lease_id, groups=[result]))

    with pytest.raises(SubmissionError, match="environment tokens after model turn 1"):
        submit([trajectories[0], trajectories[1], forged])
    assert submit(list(trajectories.values())).accepted == [group.group_id]
    batch, stats = ctl.take_batch(0, 1)
    rewards = {t.sample_index: t.reward for t in batch[0].trajectories}
    assert rewards == {0: 1.0, 1: 0.0, 2: 1.0}  # the env's @vf.reward, replayed here
    ctl.close()


def _trajectory(group, i, completion, mask):
    n = len(completion)
    return WorkerTrajectory(
        prompt_id=group.prompt_id,
        sample_index=i,
        prompt_token_ids=group.prompt_token_ids,
        completion_token_ids=completion,
        logprobs=[0.0] * n,
        versions=[0] * n,
        finish_reason="stop",
        completion_mask=mask,
    )


def test_worker_reports_carry_no_reward():
    """The wire has no field a worker could put a reward in: a trajectory with one is refused
    before anything reads it (the trusted side scores every episode itself)."""
    with pytest.raises(ValueError, match="reward"):
        WorkerTrajectory(
            prompt_id="p", sample_index=0, prompt_token_ids=[1], completion_token_ids=[2],
            logprobs=[0.0], versions=[0], finish_reason="stop", reward=1.0,
        )  # fmt: skip


@pytest.mark.vllm
def test_textarena_game_on_vllm_keeps_the_sampled_ids_and_the_replays_observations(
    qwen3_dir, qwen3_chat_engine, tmp_path
):
    from rollout_gpu.generate import generate_groups

    engine = qwen3_chat_engine
    sampled: list[list[int]] = []  # every model turn as the engine returned it

    class Recording:
        """The real engine; notes each sampled turn's ids on the way out."""

        def __getattr__(self, name):
            return getattr(engine, name)

        def generate(self, *args, **kwargs):
            out = engine.generate(*args, **kwargs)
            sampled.extend(list(c.token_ids) for cs in out for c in cs)
            return out

    codec = TextCodec(qwen3_dir)
    task = make_task("verifiers", verifiers_env=GAME, max_turns=4, turn_max_tokens=12)
    ctl, wid, lease = _controller(
        tmp_path, qwen3_dir, task, 4, max_completion_tokens=400,
        sampling=SamplingParams(max_tokens=12, stop_token_ids=[qwen3_tokenizer.token_id(EOS)]),
    )  # fmt: skip
    observe = lambda eps: ctl.episode_step(wid, EpisodeStep(lease_id=lease.lease_id, episodes=eps))
    results = generate_groups(Recording(), lease.groups, version=0, observe=observe)
    seed = int(next(r["answer"] for r in ctl.db.groups_in("leased")))
    turns = []
    for t in results[0].trajectories:
        segs = t.segments()
        model = [ids for m, ids in segs if m == 1]
        for ids in model:  # each model turn is one of the engine's samples, verbatim
            assert ids in sampled
        actions = [codec.decode(ids) for ids in model]
        rep = task.episode(Prompt("p", "", str(seed)), actions)  # the trusted replay
        shown = [ids for m, ids in segs if m == 0]
        # A turn the 12-token budget cut is closed with <|im_end|> before the observation.
        closes = [cut_turn_close(task.env, ids, codec.encode) for ids in model]
        expected = [codec.encode(c + o) for c, o in zip(closes, rep.observations, strict=False)]
        assert shown == expected[: len(shown)]
        turns.append(len(model))
    assert max(turns) >= 2, turns  # really multi-turn: the game answered a move
    r = ctl.submit(wid, Submission(lease_id=lease.lease_id, groups=results))
    assert r.accepted == [lease.groups[0].group_id]
    batch, stats = ctl.take_batch(0, 1)
    assert stats["reward/errors"] == 0
    assert all(np.isfinite(t.reward) for t in batch[0].trajectories)
    ctl.close()
