"""Multi-turn episodes on a rollout engine: the worker's side of bridge/tasks/env.py.

    results = generate_episodes(engine, lease.groups, version=3, should_abort=stop.is_set)

Each leased group with an `EpisodeSpec` is `n` episodes of the environment it names, all
from the spec's seed (the environment's own randomness is seeded, so the n episodes differ
only by what the model samples). Turn by turn, every live episode of the lease is one
engine request continuing its exact token history:

    prompt ids (the lease's) | model turn 1 | obs 1 | model turn 2 | obs 2 | ... | turn k

The model's tokens are kept exactly as sampled (EOS included), never decoded and
re-encoded; the action text the environment sees is the turn decoded with special tokens
skipped, and the next observation is encoded on its own without special tokens (after the
end-of-turn token when the token budget cut the turn, bridge/tasks/chat_turns.py
`cut_turn_close`; in the controller's mode the controller's observation carries it),
exactly as the controller's replay re-encodes it (bridge/control/intake/rewards.py checks
it, token for token). Model tokens carry their behaviour log-prob and version with mask 1,
observation tokens log-prob 0.0 and mask 0 (the learner trains on mask-1 tokens only).

An episode ends when the environment says done ("stop"), or at `max_turns` model turns or
when the token budget cannot hold another observation and turn ("length"). The step
rewards the worker's environment computes are not sent: the controller replays.

Hidden state (issue 23 item 8): the controller's leases carry no seed (`EpisodeSpec.seed`
-1; a poker seed is the deal). The observations then come from the controller, one
POST /v1/episode per turn for all live episodes of the lease (`observe`, the model turns
so far as token ids; bridge/control/intake/episode_steps.py). The controller holds what each
episode has played: a request carries each live episode once, with exactly one new turn,
and the submission must be those turns (a retry of a request gets the same answers). A
spec with a seed (tests, older controllers) is still played on a local environment.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import sys
from collections.abc import Callable, Sequence

from bridge.control.protocol import EpisodeTurns, GroupResult, PromptGroup, WorkerTrajectory
from bridge.tasks.chat_turns import cut_turn_close
from bridge.tasks.env import Environment, make_env
from rollout_gpu.engine import GenerationError, RolloutEngine, SampleRequest


@dataclasses.dataclass
class _Episode:
    group: PromptGroup
    index: int
    env: Environment | None  # None: the controller keeps it (observe)
    tokens: list[int] = dataclasses.field(default_factory=list)  # completion so far
    turn_ids: list[list[int]] = dataclasses.field(default_factory=list)  # model turns
    mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    turns: int = 0
    finish: str | None = None  # "stop" | "length" once over

    def room(self) -> int:
        """Completion tokens left in the episode's budget."""
        return self.group.episode.max_tokens - len(self.tokens)


class _Codec:
    """Text <-> ids exactly as the controller's `TextCodec` (bridge/contracts/prompt.py):
    the `tokenizers` backend of a fast HF tokenizer, so no HF-side post-processing (such as
    `clean_up_tokenization_spaces`) makes the worker's action text differ from the replay's."""

    def __init__(self, tokenizer):
        self.hf, self.raw = tokenizer, getattr(tokenizer, "backend_tokenizer", None)

    def decode(self, ids: list[int]) -> str:
        if self.raw is not None:
            return self.raw.decode(ids, skip_special_tokens=True)
        return self.hf.decode(ids, skip_special_tokens=True)

    def encode(self, text: str) -> list[int]:
        if self.raw is not None:
            return list(self.raw.encode(text, add_special_tokens=False).ids)
        return [int(t) for t in self.hf.encode(text, add_special_tokens=False)]


def _request(ep: _Episode) -> SampleRequest:
    s = ep.group.sampling
    return SampleRequest(
        prompt_token_ids=list(ep.group.prompt_token_ids) + ep.tokens,
        n=1,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        max_tokens=min(s.max_tokens, ep.room()),
        stop_token_ids=list(s.stop_token_ids),
        # Episode i is sample i of the group: its noise key is seed + i at every turn, and
        # the positions continue through the observations (bridge/contracts/gumbel.py).
        seed=s.seed + ep.index if s.seed >= 0 else None,
    )


def _start(engine: RolloutEngine, group: PromptGroup) -> list[_Episode]:
    spec = group.episode
    if len(group.prompt_token_ids) + spec.max_tokens > engine.max_model_len:
        raise GenerationError(
            f"group {group.group_id}: prompt of {len(group.prompt_token_ids)} tokens + an "
            f"episode of {spec.max_tokens} exceeds max_model_len {engine.max_model_len}"
        )
    if spec.seed < 0:  # hidden: the controller answers each observation
        return [_Episode(group, i, None) for i in range(group.n)]
    try:
        if spec.module and spec.module not in sys.modules:  # an env outside bridge.tasks
            importlib.import_module(spec.module)
        episodes = [_Episode(group, i, make_env(spec.env, **spec.options)) for i in range(group.n)]
    except Exception as e:  # noqa: BLE001 - an env this worker cannot build
        raise GenerationError(f"group {group.group_id}: cannot build env {spec.env!r}: {e}") from e
    for ep in episodes:
        ep.env.reset(spec.seed)
    return episodes


def _observe_remote(episodes: list[_Episode], observe) -> list[tuple[str, bool]]:
    """(observation, done) of each episode from the controller, one call for all."""
    if observe is None:
        raise GenerationError("a leased episode without a seed needs the controller (observe)")
    req = [EpisodeTurns(group_id=ep.group.group_id, sample_index=ep.index, turns=ep.turn_ids)
           for ep in episodes]  # fmt: skip
    try:
        got = observe(req).observations
    except Exception as e:  # noqa: BLE001 - refused or unreachable: release the lease
        raise GenerationError(f"the controller gave no observation: {e}") from e
    if len(got) != len(episodes):
        raise GenerationError(f"the controller answered {len(got)} of {len(episodes)} episodes")
    return [(o.observation, o.done) for o in got]


def _take_turn(engine: RolloutEngine, ep: _Episode, sample, version: int) -> None:
    where = f"group {ep.group.group_id} episode {ep.index} turn {ep.turns + 1}"
    if sample.finish_reason not in ("stop", "length"):
        raise GenerationError(f"{where}: finish_reason {sample.finish_reason!r}")
    ids = list(sample.token_ids)
    if not ids or sample.logprobs is None or len(sample.logprobs) != len(ids):
        raise GenerationError(f"{where}: engine returned no tokens or no log-prob for some")
    lps = [float(x) for x in sample.logprobs]
    if any(not (math.isfinite(x) and x <= 0.0) for x in lps):
        raise GenerationError(f"{where}: engine log-prob not finite and <= 0")
    ep.tokens += ids
    ep.mask += [1] * len(ids)
    ep.logprobs += lps
    ep.versions += [version] * len(ids)
    ep.turns += 1
    ep.turn_ids.append(ids)
    if ep.env is None:
        return  # the controller's observation comes with the lease's others (observe)
    codec = _Codec(engine.tokenizer)
    try:
        obs, _, done = ep.env.step(codec.decode(ids))
    except Exception as e:  # noqa: BLE001 - the environment is task code
        raise GenerationError(f"{where}: environment step failed: {e}") from e
    # A turn cut by the token budget is closed with its end-of-turn token first.
    _take_observation(engine, ep, cut_turn_close(ep.env, ids, codec.encode) + obs, done)


def _take_observation(engine: RolloutEngine, ep: _Episode, obs: str, done: bool) -> None:
    where = f"group {ep.group.group_id} episode {ep.index} turn {ep.turns}"
    tok = _Codec(engine.tokenizer)
    if done:
        ep.finish = "stop"
        return
    obs_ids = tok.encode(obs)
    if not obs_ids:
        raise GenerationError(f"{where}: the environment returned an empty observation")
    # The trajectory must end with a model turn: stop unless another turn fits after obs.
    if ep.turns >= ep.group.episode.max_turns or ep.room() < len(obs_ids) + 1:
        ep.finish = "length"
        return
    ep.tokens += obs_ids
    ep.mask += [0] * len(obs_ids)
    ep.logprobs += [0.0] * len(obs_ids)
    # The version of the turn the observation answers: versions never decrease along a
    # completion, and the next turn may already be sampled by a newer one.
    ep.versions += [ep.versions[-1]] * len(obs_ids)


def generate_episodes(
    engine: RolloutEngine,
    groups: Sequence[PromptGroup],
    version: int,
    should_abort: Callable[[], bool] = lambda: False,
    observe: Callable | None = None,
    swaps=None,
) -> list[GroupResult]:
    """Play every group's n episodes, all of a lease's turns batched per engine call;
    `observe(list[EpisodeTurns]) -> EpisodeStepResponse`: the controller's observations
    (POST /v1/episode of the lease) for episodes leased without a seed.

    `swaps` (rollout_gpu/generate.py `Swaps`, partial rollouts): between turns, when a newer
    version is ready, it is loaded and the episodes' next turns are sampled under it. Each
    model token is tagged with the version that sampled it, each observation token with its
    turn's. A turn itself is never split: a poker or tool turn is a few tokens, the
    environment's round trip between turns is where the lease waits."""
    per_group = [_start(engine, g) for g in groups]
    live = [ep for eps in per_group for ep in eps]
    served = version
    while live:
        outs = engine.generate([_request(ep) for ep in live], should_abort)
        if len(outs) != len(live):
            raise GenerationError(f"engine answered {len(outs)} of {len(live)} requests")
        for ep, samples in zip(live, outs, strict=True):
            if len(samples) != 1:
                raise GenerationError(f"engine returned {len(samples)} samples for n=1")
            _take_turn(engine, ep, samples[0], served)
        remote = [ep for ep in live if ep.env is None]
        if remote:
            for ep, (obs, done) in zip(remote, _observe_remote(remote, observe), strict=True):
                _take_observation(engine, ep, obs, done)
        live = [ep for ep in live if ep.finish is None]
        if live and swaps is not None and swaps.due():
            served = swaps.swap()
    return [
        GroupResult(
            group_id=g.group_id,
            trajectories=[
                WorkerTrajectory(
                    prompt_id=g.prompt_id,
                    sample_index=ep.index,
                    prompt_token_ids=list(g.prompt_token_ids),
                    completion_token_ids=ep.tokens,
                    logprobs=ep.logprobs,
                    versions=ep.versions,
                    finish_reason=ep.finish,
                    completion_mask=ep.mask,
                )
                for ep in eps
            ],
        )
        for g, eps in zip(groups, per_group, strict=True)
    ]
