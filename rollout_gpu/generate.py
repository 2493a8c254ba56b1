"""One lease's generation on a rollout engine: prompt groups in, trajectories out.

    results = generate_groups(engine, lease.groups, version=3, should_abort=stop.is_set)

Each `PromptGroup` becomes one engine request with `n` samples from exactly the lease's
`prompt_token_ids` (the controller builds them; a group generated from other ids is
refused), so the worker tokenizes nothing; generation stops at EOS (kept as the last
completion token, so the learner trains the stop decision) or at `max_tokens`.

Log-probs: each completion token carries the sampled token's log-prob, and the engine
must run in `processed_logprobs` mode (checked here): the log-softmax of the distribution
the token was sampled from, log softmax(logits / temperature), which is what the learner
recomputes (it divides its logits by the same temperature; top-p/top-k are refused by its
config validation, so no truncation ever reaches a worker from our controller).

Sampling: each group's request carries the group's seed (`SamplingParams.seed`), and the
engine draws every token as argmax(z + g) with z the processed logits and g the Gumbel
noise of bridge/contracts/gumbel.py keyed by (seed + sample index, position in the whole
sequence) (rollout_gpu/verifiable_sampler.py), so the learner can check each token exactly;
the log-probs above stay those of z.

Versions: each completion token is tagged with the version the engine served when it was
sampled. Without partial rollouts the engine swaps weights only between leases, so every
token of a lease carries the version it started under. With them (`Lease.partial ==
"continue"`, `continue_groups`) the engine is paused as soon as a newer version is ready,
the version swapped in, and every unfinished sample continued under it from its prompt and
its tokens so far: one single-sample request keyed by the same seed (group seed + sample
index), so the sampler's noise at each position is the one the uninterrupted sample would
have drawn (it is keyed by the position in the whole sequence), and the tokens after the
swap are tagged with the new version. Each token keeps the log-prob of the distribution it
was drawn from, the one the learner's per-token correction and the exact check use.
Multi-turn episodes take the newer version between turns (their next turn continues the
whole history under it, keyed the same way), never inside one.

Routing: a MoE engine records the experts every forwarded token was routed to
(rollout_gpu/routing_capture.py); each trajectory carries them (bridge/contracts/routing.py),
complete or not at all.

Multi-turn episodes (a group with an `EpisodeSpec`) are played by rollout_gpu/episodes.py;
a single-turn group is their one-step case.

No rewards here: the controller scores each completion itself from its token ids and
never sends the reference answers out (bridge/control/intake/rewards.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from bridge.contracts import routing
from bridge.contracts.prompt import PromptFormat, format_prompt_ids
from bridge.control.protocol import GroupResult, PromptGroup, RoutedExperts, WorkerTrajectory
from rollout_gpu.engine import (
    Completion,
    GenerationAborted,
    GenerationError,
    RolloutEngine,
    SampleRequest,
)

__all__ = [
    "GenerationAborted",
    "GenerationError",
    "Swaps",
    "check_logprobs_mode",
    "continue_groups",
    "generate_groups",
]


def check_logprobs_mode(engine: RolloutEngine) -> None:
    mode = engine.logprobs_mode
    if mode != "processed_logprobs":
        raise ValueError(
            f"engine logprobs_mode={mode!r}; rollouts need 'processed_logprobs' (the "
            "log-softmax of the tempered distribution sampled from, which the learner "
            "recomputes)"
        )


def prompt_token_ids(tokenizer, text: str, fmt: PromptFormat | None = None) -> list[int]:
    """The contract's prompt ids (`format_prompt_ids`) from an HF tokenizer: the ids the
    controller leases for `text` in format `fmt` (default plain)."""
    special = {k: v for k, v in tokenizer.special_tokens_map.items() if isinstance(v, str)}
    return format_prompt_ids(
        text,
        fmt or PromptFormat(),
        lambda s: tokenizer.encode(s, add_special_tokens=False),
        tokenizer.bos_token_id,
        tokenizer.chat_template,
        special,
    )


def sample_request(group: PromptGroup, ids: Sequence[int]) -> SampleRequest:
    s = group.sampling
    return SampleRequest(
        prompt_token_ids=list(ids),
        n=group.n,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        max_tokens=s.max_tokens,
        stop_token_ids=list(s.stop_token_ids),
        seed=s.seed if s.seed >= 0 else None,
    )


def warm_up_request() -> SampleRequest:
    """A tiny sampling request through the same path as a lease's (log-probs, a tempered
    distribution), for the worker's warm-up before its first lease."""
    return SampleRequest(prompt_token_ids=[1, 2, 3], n=2, temperature=0.9, max_tokens=4)


def _checked_logprobs(sample: Completion, where: str) -> list[float]:
    tokens = list(sample.token_ids)
    if sample.logprobs is None or len(sample.logprobs) != len(tokens):
        raise GenerationError(f"{where}: engine returned no log-prob for some tokens")
    logprobs = [float(x) for x in sample.logprobs]
    bad = [x for x in logprobs if not (math.isfinite(x) and x <= 0.0)]
    if bad:
        raise GenerationError(f"{where}: engine log-prob {bad[0]} is not finite and <= 0")
    return logprobs


def _trajectory(group: PromptGroup, sample: Completion, version: int) -> WorkerTrajectory:
    where = f"group {group.group_id} sample {sample.index}"
    if sample.finish_reason not in ("stop", "length"):
        raise GenerationError(f"{where}: finish_reason {sample.finish_reason!r}")
    tokens = list(sample.token_ids)
    return WorkerTrajectory(
        prompt_id=group.prompt_id,
        sample_index=sample.index,
        prompt_token_ids=list(group.prompt_token_ids),
        completion_token_ids=tokens,
        logprobs=_checked_logprobs(sample, where),
        versions=[version] * len(tokens),
        finish_reason=sample.finish_reason,
        routed_experts=_routing(sample, len(group.prompt_token_ids), where),
    )


def _routing(sample: Completion, prompt_len: int, where: str) -> RoutedExperts | None:
    """A MoE engine's recorded routing on the wire; every forwarded position must have
    one (a gap would hand the learner a guess)."""
    ids = sample.routed_experts
    if ids is None:
        return None
    rows = routing.num_rows(prompt_len, len(sample.token_ids))
    if ids.shape[0] != rows or (ids < 0).any():
        missing = int((ids < 0).any(axis=(1, 2)).sum()) if ids.ndim == 3 else -1
        raise GenerationError(
            f"{where}: engine routing has {ids.shape[0]} rows ({missing} unrecorded), "
            f"needs {rows} complete ones"
        )
    return RoutedExperts(**routing.encode(ids))


def _check_fits(engine: RolloutEngine, groups: Sequence[PromptGroup]) -> None:
    max_len = engine.max_model_len
    for g in groups:
        ids = g.prompt_token_ids
        if len(ids) + g.sampling.max_tokens > max_len:
            raise GenerationError(
                f"group {g.group_id}: prompt of {len(ids)} tokens + max_tokens "
                f"{g.sampling.max_tokens} exceeds the engine's max_model_len {max_len}"
            )


@dataclasses.dataclass(frozen=True)
class Swaps:
    """How a partial rollout meets a newer version: `due()` (polled each engine step) says
    one is ready to load; `swap()` loads it and returns the version the engine serves then
    (the same one if the load was refused)."""

    due: Callable[[], bool]
    swap: Callable[[], int]


def continuation_request(group: PromptGroup, index: int, tokens: Sequence[int]) -> SampleRequest:
    """Sample `index` of `group` continued after its `tokens` so far: one sample keyed by
    the sample's own seed, the rest of the token budget."""
    s = group.sampling
    return SampleRequest(
        prompt_token_ids=[*group.prompt_token_ids, *tokens],
        n=1,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        max_tokens=s.max_tokens - len(tokens),
        stop_token_ids=list(s.stop_token_ids),
        seed=s.seed + index if s.seed >= 0 else None,
    )


def continue_groups(
    engine: RolloutEngine,
    groups: Sequence[PromptGroup],
    version: int,
    swaps: Swaps,
    should_abort: Callable[[], bool] = lambda: False,
    observe: Callable | None = None,
) -> list[GroupResult]:
    """`generate_groups` with partial rollouts: whenever `swaps.due()` the engine pauses,
    `swaps.swap()` loads the newer version, and the unfinished samples go on under it
    (module docstring); multi-turn episodes take it between turns (rollout_gpu/episodes.py).
    Each token is tagged with the version that sampled it: `version` until the first swap."""
    single = [g for g in groups if g.episode is None]
    done, served = {}, version
    if single:
        results, served = _continue_single(engine, single, version, swaps, should_abort)
        done.update((r.group_id, r) for r in results)
    if len(single) < len(groups):
        from rollout_gpu.episodes import generate_episodes

        multi = [g for g in groups if g.episode is not None]
        episodes = generate_episodes(engine, multi, served, should_abort, observe, swaps)
        done.update((r.group_id, r) for r in episodes)
    return [done[g.group_id] for g in groups]


def _continue_single(
    engine: RolloutEngine,
    groups: Sequence[PromptGroup],
    version: int,
    swaps: Swaps,
    should_abort: Callable[[], bool],
) -> tuple[list[GroupResult], int]:
    """`continue_groups` of single-turn groups; (results, the version served at the end)."""
    if getattr(engine, "records_routing", False):
        # A continued sample's routing would be split across versions' forwards; replay
        # needs one complete record per position, so the two are not combined.
        raise GenerationError("partial rollouts do not carry a MoE engine's routing")
    _check_fits(engine, groups)
    keys = [(gi, i) for gi, g in enumerate(groups) for i in range(g.n)]
    sampled: dict = {k: ([], [], []) for k in keys}  # tokens, log-probs, versions
    finished: dict = {}
    served, pausing = version, swaps.due
    while len(finished) < len(keys):
        todo = [k for k in keys if k not in finished]
        requests = [continuation_request(groups[gi], i, sampled[gi, i][0]) for gi, i in todo]
        outs = engine.generate(requests, should_abort, pausing)
        if len(outs) != len(todo):
            raise GenerationError(f"engine answered {len(outs)} of {len(todo)} requests")
        for (gi, i), samples in zip(todo, outs, strict=True):
            where = f"group {groups[gi].group_id} sample {i}"
            if len(samples) != 1:
                raise GenerationError(f"{where}: {len(samples)} samples for one request")
            (c,) = samples
            tokens, logprobs, versions = sampled[gi, i]
            logprobs += _checked_logprobs(c, where)
            tokens += c.token_ids
            versions += [served] * len(c.token_ids)
            if c.finish_reason in ("stop", "length"):
                finished[gi, i] = c.finish_reason
            elif c.finish_reason != "paused":
                raise GenerationError(f"{where}: finish_reason {c.finish_reason!r}")
            elif len(tokens) >= groups[gi].sampling.max_tokens:
                finished[gi, i] = "length"
        if len(finished) < len(keys):
            now = swaps.swap()
            # A refused load leaves the engine on `served`: go on without pausing again.
            pausing = swaps.due if now != served else (lambda: False)
            served = now
    results = []
    for gi, g in enumerate(groups):
        trajs = []
        for i in range(g.n):
            tokens, logprobs, versions = sampled[gi, i]
            trajs.append(WorkerTrajectory(
                prompt_id=g.prompt_id,
                sample_index=i,
                prompt_token_ids=list(g.prompt_token_ids),
                completion_token_ids=list(tokens),
                logprobs=logprobs,
                versions=versions,
                finish_reason=finished[gi, i],
            ))  # fmt: skip
        results.append(GroupResult(group_id=g.group_id, trajectories=trajs))
    return results, served


def generate_groups(
    engine: RolloutEngine,
    groups: Sequence[PromptGroup],
    version: int,
    should_abort: Callable[[], bool] = lambda: False,
    observe: Callable | None = None,
) -> list[GroupResult]:
    """Sample and package every group (all or nothing: raises on the first problem).
    Groups with an `EpisodeSpec` are multi-turn episodes (rollout_gpu/episodes.py; their
    observations from `observe`, the controller's POST /v1/episode for this lease)."""
    if any(g.episode is not None for g in groups):
        from rollout_gpu.episodes import generate_episodes

        multi = [g for g in groups if g.episode is not None]
        single = [g for g in groups if g.episode is None]
        episodes = generate_episodes(engine, multi, version, should_abort, observe)
        done = {r.group_id: r for r in episodes}
        if single:
            done.update(
                (r.group_id, r) for r in generate_groups(engine, single, version, should_abort)
            )
        return [done[g.group_id] for g in groups]
    _check_fits(engine, groups)
    requests = [sample_request(g, g.prompt_token_ids) for g in groups]
    outs = engine.generate(requests, should_abort)
    if len(outs) != len(groups):
        raise GenerationError(f"engine answered {len(outs)} of {len(groups)} requests")
    results = []
    for group, samples in zip(groups, outs, strict=True):
        trajs = [_trajectory(group, s, version) for s in samples]
        results.append(GroupResult(group_id=group.group_id, trajectories=trajs))
    return results
