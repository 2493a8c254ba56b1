"""One lease's generation on a rollout engine: prompt groups in, scored trajectories out.

    results = generate_groups(engine, lease.groups, version=3, should_abort=stop.is_set)

Each `PromptGroup` becomes one engine request with `n` samples. Prompt tokens are the
engine tokenizer's ids of the prompt text with BOS prepended (no other special tokens);
generation stops at EOS (kept as the last completion token, so the learner trains the
stop decision) or at `max_tokens`.

Log-probs: each completion token carries the sampled token's log-prob, and the engine
must run in `raw_logprobs` mode (checked here): the model's log-softmax before
temperature/top-k/top-p, i.e. exactly what the learner recomputes. With temperature 1
and no truncation that is also the sampling distribution.

Versions: the engine only swaps weights between leases, so every token of a lease was
sampled by the one version the engine served when it started; each completion token is
tagged with it.

Rewards go through `bridge.tasks.score`, on the completion text decoded without special
tokens; a reward function that raises or returns a non-number raises `RewardError` here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from bridge.contracts.prompt import prompt_ids
from bridge.control.protocol import GroupResult, PromptGroup, Trajectory
from bridge.tasks import Prompt, cached_task, score
from rollout_gpu.engine import (
    Completion,
    GenerationAborted,
    GenerationError,
    RolloutEngine,
    SampleRequest,
)

__all__ = ["GenerationAborted", "GenerationError", "check_raw_logprobs", "generate_groups"]


def check_raw_logprobs(engine: RolloutEngine) -> None:
    mode = engine.logprobs_mode
    if mode != "raw_logprobs":
        raise ValueError(
            f"engine logprobs_mode={mode!r}; rollouts need 'raw_logprobs' (the model's "
            "log-softmax, which the learner recomputes)"
        )


def prompt_token_ids(tokenizer, text: str) -> list[int]:
    return prompt_ids(tokenizer.bos_token_id, tokenizer.encode(text, add_special_tokens=False))


def sample_request(group: PromptGroup, ids: Sequence[int]) -> SampleRequest:
    s = group.sampling
    return SampleRequest(
        prompt_token_ids=list(ids),
        n=group.n,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        max_tokens=s.max_tokens,
        stop_token_ids=list(s.stop_token_ids),
    )


def _trajectory(group, sample: Completion, prompt_ids, version, task, tokenizer) -> Trajectory:
    where = f"group {group.group_id} sample {sample.index}"
    if sample.finish_reason not in ("stop", "length"):
        raise GenerationError(f"{where}: finish_reason {sample.finish_reason!r}")
    tokens = list(sample.token_ids)
    if sample.logprobs is None or len(sample.logprobs) != len(tokens):
        raise GenerationError(f"{where}: engine returned no log-prob for some tokens")
    logprobs = [float(x) for x in sample.logprobs]
    bad = [x for x in logprobs if not (math.isfinite(x) and x <= 0.0)]
    if bad:
        raise GenerationError(f"{where}: engine log-prob {bad[0]} is not finite and <= 0")
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    reward = score(task, Prompt(group.prompt_id, group.prompt, group.answer), text)
    return Trajectory(
        prompt_id=group.prompt_id,
        sample_index=sample.index,
        prompt_token_ids=prompt_ids,
        completion_token_ids=tokens,
        logprobs=logprobs,
        versions=[version] * len(tokens),
        reward=reward,
        finish_reason=sample.finish_reason,
    )


def _task(group: PromptGroup):
    try:
        return cached_task(group.task, group.task_options)
    except Exception as e:  # noqa: BLE001 - unknown name or options this worker cannot build
        raise GenerationError(
            f"group {group.group_id}: task {group.task!r} with options {group.task_options} "
            f"cannot be built on this worker: {type(e).__name__}: {e}"
        ) from e


def generate_groups(
    engine: RolloutEngine,
    groups: Sequence[PromptGroup],
    version: int,
    should_abort: Callable[[], bool] = lambda: False,
) -> list[GroupResult]:
    """Sample, score and package every group (all or nothing: raises on the first problem)."""
    tokenizer = engine.tokenizer
    tasks = [_task(g) for g in groups]  # before generating: an unknown task wastes nothing
    prompt_ids = [prompt_token_ids(tokenizer, g.prompt) for g in groups]
    max_len = engine.max_model_len
    for g, ids in zip(groups, prompt_ids, strict=True):
        if len(ids) + g.sampling.max_tokens > max_len:
            raise GenerationError(
                f"group {g.group_id}: prompt of {len(ids)} tokens + max_tokens "
                f"{g.sampling.max_tokens} exceeds the engine's max_model_len {max_len}"
            )
    requests = [sample_request(g, ids) for g, ids in zip(groups, prompt_ids, strict=True)]
    outs = engine.generate(requests, should_abort)
    if len(outs) != len(groups):
        raise GenerationError(f"engine answered {len(outs)} of {len(groups)} requests")
    results = []
    for group, samples, ids, task in zip(groups, outs, prompt_ids, tasks, strict=True):
        trajs = [_trajectory(group, s, ids, version, task, tokenizer) for s in samples]
        results.append(GroupResult(group_id=group.group_id, trajectories=trajs))
    return results
