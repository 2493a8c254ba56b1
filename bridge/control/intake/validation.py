"""Checks on a submitted group of trajectories, before the controller changes any state.

Pydantic already refused wrong types, NaN/inf and absurd sizes on the wire; these are
the checks that need the controller's context: the lease's group, the vocabulary, the
configured length limits, the newest published version and the prompt token ids the
controller itself built for the leased prompt (a group generated from any other prompt is
refused, so the learner trains only on prompts the controller leased). Each failure is a
`SubmissionError` carrying an HTTP status and a message naming the offending field.
"""

from __future__ import annotations

import dataclasses

from bridge.contracts import routing as routing_contract
from bridge.control.intake import token_arrays
from bridge.control.protocol import EpisodeSpec, GroupResult, SamplingParams, WorkerTrajectory


class SubmissionError(ValueError):
    """A refused request; `status` is the HTTP status the service answers with."""

    status = 422

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status


@dataclasses.dataclass(frozen=True)
class RoutingRule:
    """What a trajectory's recorded routing must look like: the policy's sparse layers,
    experts per token and experts (all 0: a dense policy, routing refused), and whether
    every single-turn trajectory must carry it (the learner replays it)."""

    num_layers: int = 0
    k: int = 0
    num_experts: int = 0
    required: bool = False


def check_routing(t: WorkerTrajectory, where: str, rule: RoutingRule, episode) -> None:
    """SubmissionError unless `t.routed_experts` fits the policy and the trajectory."""
    r = t.routed_experts
    if r is None:
        if rule.required and episode is None:
            raise SubmissionError(
                f"{where}: no routed_experts; this run replays the engine's MoE routing, "
                "so every trajectory must carry it"
            )
        return
    if rule.num_experts == 0:
        raise SubmissionError(f"{where}: routed_experts sent, but the policy has no experts")
    if episode is not None:
        raise SubmissionError(f"{where}: routed_experts on a multi-turn episode (unsupported)")
    try:
        ids = routing_contract.decode(r.num_layers, r.k, r.ids)
        routing_contract.check(
            ids,
            rows=routing_contract.num_rows(len(t.prompt_token_ids), len(t.completion_token_ids)),
            num_layers=rule.num_layers,
            k=rule.k,
            num_experts=rule.num_experts,
        )
    except routing_contract.RoutingError as e:
        raise SubmissionError(f"{where}: routed_experts: {e}") from None


def check_group(
    result: GroupResult,
    *,
    prompt_id: str,
    n: int,
    sampling: SamplingParams,
    vocab_size: int,
    max_prompt_tokens: int,
    newest_version: int,
    prompt_token_ids: list[int],
    episode: EpisodeSpec | None = None,
    lease_version: int | None = None,
    routing: RoutingRule = RoutingRule(),
) -> None:
    """Raise SubmissionError (422) unless `result` is a complete, well-formed group.

    `episode`: the leased group is a multi-turn episode; its completion mask must then
    alternate model turns of at most `sampling.max_tokens` tokens (at most
    `episode.max_turns` of them) with environment tokens, start and end with a model turn,
    and the whole completion fit `episode.max_tokens`. Whether the environment tokens are
    the environment's is checked by the replay (bridge/control/intake/rewards.py).

    `lease_version`: the version the worker held when it took the lease (None: unknown, a
    lease from before this check). A worker's versions only go up, so no token may carry
    an older one (issue 23 item 5): an older tag is a version the lease did not give, a way
    to send rows to the sampled re-score instead of the train step's audit. Newer tags (a
    swap mid-generation) are allowed up to the newest published; every tag, mixed rows
    included, is audited (learner_jax/rl/rescore.py).

    `routing`: the shape a MoE policy's recorded routing must have (`check_routing`)."""
    g = f"group {result.group_id}"
    trajs = result.trajectories
    if len(trajs) != n:
        raise SubmissionError(f"{g}: incomplete, has {len(trajs)} trajectories, needs {n}")
    indices = sorted(t.sample_index for t in trajs)
    if indices != list(range(n)):
        raise SubmissionError(f"{g}: sample_index values must be 0..{n - 1} once each")
    for t in trajs:
        where = f"{g} sample {t.sample_index}"
        if t.prompt_id != prompt_id:
            raise SubmissionError(f"{where}: prompt_id {t.prompt_id!r} != leased {prompt_id!r}")
        if not 1 <= len(t.prompt_token_ids) <= max_prompt_tokens:
            raise SubmissionError(
                f"{where}: prompt has {len(t.prompt_token_ids)} tokens, "
                f"allowed 1..{max_prompt_tokens}"
            )
        if t.prompt_token_ids != prompt_token_ids:
            raise SubmissionError(
                f"{where}: prompt_token_ids differ from the leased prompt's "
                f"({len(t.prompt_token_ids)} vs {len(prompt_token_ids)} tokens); "
                "generate from PromptGroup.prompt_token_ids exactly"
            )
        length = len(t.completion_token_ids)
        budget = sampling.max_tokens if episode is None else episode.max_tokens
        if length > budget:
            what = "max_tokens" if episode is None else "the episode's max_tokens"
            raise SubmissionError(f"{where}: completion has {length} tokens > {what} {budget}")
        if len(t.logprobs) != length or len(t.versions) != length:
            raise SubmissionError(
                f"{where}: need one logprob and one version per completion token "
                f"({length}), got {len(t.logprobs)} and {len(t.versions)}"
            )
        _check_mask(t, where, sampling, episode)
        for name, ids in (("prompt", t.prompt_token_ids), ("completion", t.completion_token_ids)):
            at = token_arrays.first_outside(ids, 0, vocab_size)
            if at is not None:
                raise SubmissionError(
                    f"{where}: {name} token id {ids[at]} outside the vocabulary [0, {vocab_size})"
                )
        at = token_arrays.first_bad_logprob(t.logprobs)
        if at is not None:
            raise SubmissionError(f"{where}: log-prob {t.logprobs[at]} is not finite and <= 0")
        low, high, down = token_arrays.version_span(t.versions)
        if low < 0:
            raise SubmissionError(f"{where}: negative policy version {low}")
        if high > newest_version:
            raise SubmissionError(
                f"{where}: policy version {high} is from the future "
                f"(newest published is {newest_version})"
            )
        if down:
            raise SubmissionError(f"{where}: versions must not decrease along the completion")
        if lease_version is not None and low < lease_version:
            raise SubmissionError(
                f"{where}: a token of version {low} but the lease was taken at "
                f"version {lease_version}; a worker's versions only go up"
            )
        check_routing(t, where, routing, episode)


def _check_mask(
    t: WorkerTrajectory, where: str, sampling: SamplingParams, episode: EpisodeSpec | None
) -> None:
    """The completion mask's shape: none (or all ones) for a single-turn group; for an
    episode, model turns within the limits, environment tokens with log-prob 0."""
    mask = t.completion_mask
    if mask is None:
        if episode is not None:
            raise SubmissionError(f"{where}: an episode needs a completion_mask")
        return
    if len(mask) != len(t.completion_token_ids):
        raise SubmissionError(
            f"{where}: completion_mask has {len(mask)} entries for "
            f"{len(t.completion_token_ids)} completion tokens"
        )
    if episode is None:
        if 0 in mask:
            raise SubmissionError(f"{where}: environment tokens (mask 0) in a single-turn group")
        return
    segments = t.segments()
    if segments[0][0] != 1 or segments[-1][0] != 1:
        raise SubmissionError(f"{where}: an episode must start and end with a model turn")
    turns = [ids for m, ids in segments if m == 1]
    if len(turns) > episode.max_turns:
        raise SubmissionError(f"{where}: {len(turns)} model turns > max_turns {episode.max_turns}")
    longest = max(len(ids) for ids in turns)
    if longest > sampling.max_tokens:
        raise SubmissionError(
            f"{where}: a model turn has {longest} tokens > max_tokens {sampling.max_tokens}"
        )
    env_lp = [x for x, m in zip(t.logprobs, mask, strict=True) if m == 0 and x != 0.0]
    if env_lp:
        raise SubmissionError(f"{where}: environment tokens must carry log-prob 0, got {env_lp[0]}")
