"""Wire protocol between the controller and rollout workers: pydantic models, JSON over HTTP.

One round trip per purpose, and every response a worker polls (heartbeat, lease, submit)
carries the newest `VersionAnnouncement` plus `swap_to` when the worker is behind, so
version news costs no extra request.

    worker                                   controller
    POST /v1/register  RegisterRequest  ->   RegisterResponse (worker_id, token)
    POST /v1/heartbeat Heartbeat        ->   HeartbeatResponse (renews the worker's leases)
    POST /v1/lease     LeaseRequest     ->   LeaseResponse (a Lease, or why not + retry_after_s)
    POST /v1/submit    Submission       ->   SubmitResponse (idempotent per group)
    POST /v1/release   Release          ->   Ack (give a lease back, requeued at once)
    POST /v1/leave                      ->   Ack (token revoked, leases requeued)
    GET  /v1/version                    ->   VersionAnnouncement
    GET  /v1/status                     ->   controller stats + fleet table (dict; also
                                             with the join secret as bearer: bridge/status.py)

Every call but /v1/register sends `Authorization: Bearer <worker token>`. Any call may
be answered 429 with `Retry-After` (rate limits, bridge/control/trust/limits.py); a token
unused for `token_ttl_s` expires (401: register again).

Weight broadcast (bridge/broadcast): heartbeats may carry the worker's relay URL, its
measured up/down rates and a `BroadcastReport` of its last fetch; heartbeat and lease
responses carry its route (`broadcast_mode`, `relay_parent`, `relay_fallbacks`).

Run end: once the learner calls `Controller.end_run()`, every heartbeat answers
`run_over=true` and every lease `reason="run_over"`; a worker then leaves and exits 0.
`active=false` puts a worker on standby (no leases until a heartbeat says active again).

Trust: a lease carries each prompt's token ids as the controller built them and no
reference answer; a worker submits `WorkerTrajectory`s (no reward: the controller scores
the completion ids itself, bridge/control/intake/rewards.py). `Trajectory` adds the controller's
reward and exists on the trusted side only.

MoE policies: each trajectory carries the experts the worker's engine routed every token
to (`RoutedExperts`), which the learner may replay (`model.moe.routing_replay`); like the
log-probs it is checked at intake and audited against the learner's own routing.

Multi-turn (bridge/tasks/env.py): a group of an environment task carries an `EpisodeSpec`;
each trajectory is then one episode, its completion the model's turns and the environment's
observation tokens marked by `completion_mask`. The controller replays the environment from
(seed, decoded actions), re-encodes every observation itself and refuses (422) an episode
whose observation tokens differ; the replay's reward is the only one used.

Versions: a policy version is the learner step whose parameters generated a token
(version v = weights after v updates). A trajectory tags every completion token with
its version, so a hot swap in the middle of a generation is visible; the staleness of a
trajectory is judged by its oldest token.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

# Hard caps on list sizes so a hostile payload fails pydantic validation before any work;
# the controller checks the tighter, configured limits itself.
_MAX_TOKENS = 1 << 16
_MAX_SAMPLES = 1024
_MAX_GROUPS = 4096


class _Model(BaseModel):
    # NaN/inf never cross the wire; unknown fields are refused so typos fail loudly.
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid", frozen=True)


class WorkerProfile(_Model):
    accelerator: str = Field(max_length=128, description="e.g. 'H100-80GB' or 'cpu'")
    price_per_hour: float = Field(ge=0.0, le=1e6, description="USD per hour while active")
    max_concurrent_sequences: int = Field(ge=1, le=1 << 20)
    region: str = Field(default="", max_length=128)
    name: str = Field(
        default="", max_length=128, description="the provisioner's name for it (bridge/fleet)"
    )
    engine_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="bfloat16",
        description="its engine's compute dtype: the exact check allows a bf16/fp16 engine "
        "the margin its numerics need, an fp32 engine none (bridge/contracts/exact_check.py)",
    )


class RegisterRequest(_Model):
    join_secret: str = Field(max_length=1024)
    profile: WorkerProfile


class VersionAnnouncement(_Model):
    """The newest published policy version and where to read it (a weight-store spec)."""

    version: int = Field(ge=-1, description="-1 = nothing published yet")
    store: dict[str, Any] | str | None = Field(
        default=None,
        description="where to read it: a bridge.store.weight_store.WeightStore spec (URL or dict)",
    )
    published_at: float = 0.0
    manifest_sha256: str | None = Field(
        default=None,
        pattern=r"^[0-9a-f]{64}$",
        description="SHA-256 of the version's manifest as published: a worker refuses a "
        "manifest that differs, from a peer or its own relay's copy (None: not known; the "
        "manifest is then read from the store only)",
    )


class RegisterResponse(_Model):
    worker_id: str
    token: str
    heartbeat_interval_s: float
    lease_ttl_s: float
    announcement: VersionAnnouncement


class SourceReport(_Model):
    """A weight source that failed a worker during a fetch (bridge/broadcast/state.py)."""

    source: str = Field(max_length=512, description="relay URL, or 'store'")
    kind: Literal["corrupt", "dead"]
    key: str = Field(
        default="", max_length=512, description="the store key of the chunk (corrupt: required)"
    )


class BroadcastReport(_Model):
    """How the worker's last version fetch went (peer-assisted broadcast, bridge/broadcast)."""

    version: int = Field(ge=0)
    fetched_ago_s: float = Field(ge=0.0, le=1e8, description="completed this long ago")
    fetch_s: float = Field(default=0.0, ge=0.0, le=1e8)
    bytes_from_store: int = Field(default=0, ge=0, le=1 << 60)
    bytes_from_peers: int = Field(default=0, ge=0, le=1 << 60)
    bad_sources: list[SourceReport] = Field(default_factory=list, max_length=64)


class Heartbeat(_Model):
    worker_version: int = Field(ge=-1, description="the policy version the worker now serves")
    samples_per_s: float = Field(default=0.0, ge=0.0, le=1e9, description="measured")
    tokens_per_s: float = Field(default=0.0, ge=0.0, le=1e12, description="measured")
    active_sequences: int = Field(default=0, ge=0, le=1 << 24)
    relay_url: str = Field(default="", max_length=512, description="this worker's weight relay")
    up_bytes_per_s: float = Field(default=0.0, ge=0.0, le=1e13, description="relay, measured")
    down_bytes_per_s: float = Field(default=0.0, ge=0.0, le=1e13, description="fetch, measured")
    broadcast: BroadcastReport | None = None
    unloadable_version: int = Field(
        default=-1,
        ge=-1,
        description="the announced version this worker failed to load, -1: none (a worker "
        "with no version loaded asks for no lease, so it reports here)",
    )
    news_after: float | None = Field(
        default=None,
        ge=0.0,
        le=1e12,
        description="hold the answer until a version published after this time (the "
        "published_at of the newest announcement the worker has heard) is announced, at "
        "most one heartbeat interval: a worker generating a partial-rollout lease hears of "
        "a new version when it is published (http/version_news.py)",
    )


class _Route(_Model):
    """Where to fetch the next version from (bridge/broadcast/topology.py); the store is
    always the last fallback. Absent/None: read the store directly (bridge.broadcast=store)."""

    broadcast_mode: Literal["store", "chain", "tree"] = "store"
    relay_parent: str | None = Field(default=None, description="parent relay URL")
    relay_fallbacks: list[str] = Field(default_factory=list, description="then these relays")


class HeartbeatResponse(_Route):
    announcement: VersionAnnouncement
    swap_to: int | None = Field(default=None, description="swap to this version first")
    active: bool = Field(default=True, description="false: the fleet does not need you now")
    run_over: bool = Field(default=False, description="true: training ended; leave and exit")
    renewed_leases: list[str] = Field(default_factory=list)
    heartbeat_interval_s: float | None = Field(
        default=None, description="heartbeat again after this long (grows with the fleet)"
    )


class SamplingParams(_Model):
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    max_tokens: int = Field(default=16, ge=1, le=_MAX_TOKENS)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    seed: int = Field(
        default=-1,
        ge=-1,
        lt=1 << 62,
        description="the group's sampling seed (bridge/contracts/gumbel.py): sample i draws "
        "its noise from key seed + i; -1: none (the learner then cannot verify the tokens)",
    )


class EpisodeSpec(_Model):
    """A multi-turn episode to play from the prompt (bridge/tasks/env.py): at most
    `max_turns` model turns of `SamplingParams.max_tokens` tokens each and at most
    `max_tokens` completion tokens in all (model and environment tokens together). The
    controller's leases say `seed` -1: the seed (a poker deal) stays on the controller and
    each observation comes from POST /v1/episode, turn by turn (issue 23 item 8). With a
    seed >= 0 the worker runs the environment `env` built with `options` itself."""

    env: str = Field(max_length=128)
    module: str = Field(
        default="", max_length=256, description="import it first: it registers `env`"
    )
    options: dict[str, Any] = Field(default_factory=dict)
    seed: int = Field(default=-1, ge=-1, lt=1 << 62, description="-1: hidden (POST /v1/episode)")
    max_turns: int = Field(ge=1, le=1024)
    max_tokens: int = Field(ge=1, le=_MAX_TOKENS)


class EpisodeTurns(_Model):
    """One leased episode's model turns so far, token ids exactly as sampled: the turns
    already answered and one new turn (the same turns again: the answer already given)."""

    group_id: int
    sample_index: int = Field(ge=0, le=1 << 16)
    turns: list[list[int]] = Field(min_length=1, max_length=1024)


class EpisodeStep(_Model):
    """POST /v1/episode: the next observation of each episode, after its last turn. The
    controller holds what each episode has played (bridge/control/intake/episode_steps.py): an
    episode appears once per request and cannot be rewound; a submitted episode must be
    the turns played here. Replays are budgeted per worker (429 with Retry-After)."""

    lease_id: str = Field(max_length=128)
    episodes: list[EpisodeTurns] = Field(min_length=1, max_length=4096)


class EpisodeObservation(_Model):
    observation: str = Field(default="", description="empty once the episode is done")
    done: bool


class EpisodeStepResponse(_Model):
    observations: list[EpisodeObservation] = Field(description="in the request's order")


class PromptGroup(_Model):
    """One prompt to sample `n` completions of (a GRPO group).

    No reference answer and no reward recipe: the controller scores completions itself.
    The worker generates from `prompt_token_ids` exactly (the controller's own encoding,
    bridge/contracts/prompt.py) and echoes them in each trajectory; `prompt` is the same
    prompt as text, for logs."""

    group_id: int
    prompt_id: str
    task: str = Field(description="the task's name (informational)")
    prompt: str
    prompt_token_ids: list[int] = Field(min_length=1, max_length=_MAX_TOKENS)
    n: int = Field(ge=1, le=_MAX_SAMPLES)
    sampling: SamplingParams
    episode: EpisodeSpec | None = Field(
        default=None, description="set for a multi-turn task: play n episodes, not n samples"
    )


class LeaseRequest(_Model):
    worker_version: int = Field(ge=-1)
    max_groups: int = Field(default=1, ge=1, le=_MAX_GROUPS)
    unloadable_version: int = Field(
        default=-1, ge=-1, description="the newest version this worker failed to load, -1: none"
    )
    fetching_version: int = Field(
        default=-1,
        ge=-1,
        description="a version this worker is fetching in the background (peer broadcast) "
        "while it keeps generating on its own, -1: none",
    )


class Lease(_Model):
    lease_id: str
    expires_at: float = Field(description="controller clock; heartbeats renew it")
    groups: list[PromptGroup]
    partial: Literal["off", "continue"] = Field(
        "off",
        description="continue: on news of a newer version mid-lease, swap it in and continue "
        "the unfinished samples under it, tagging each token with its version",
    )


class LeaseResponse(_Route):
    lease: Lease | None = None
    reason: Literal[
        "ok",
        "behind",
        "full",
        "no_version",
        "inactive",
        "empty",
        "too_slow",
        "run_over",
        "lease_limit",  # the worker holds max_leases_per_worker active leases already
    ] = "ok"
    retry_after_s: float = 0.0
    announcement: VersionAnnouncement
    swap_to: int | None = None
    eval_pending: bool = Field(
        default=False,
        description="more evaluation work of the worker's version is queued: keep that "
        "version loaded (do not swap) and ask again (bridge/control/evaluation/eval_leases.py)",
    )


class RoutedExperts(_Model):
    """The experts a MoE engine routed each forwarded token to (bridge/contracts/routing.py):
    [rows, num_layers, k] expert ids, rows = prompt + completion - 1, the last `completion`
    rows one per completion token; little-endian uint16, row-major, base64. Data to check:
    the controller validates it and the learner audits it against its own routing."""

    num_layers: int = Field(ge=1, le=4096, description="the model's sparse layers, in order")
    k: int = Field(ge=1, le=4096, description="experts per token")
    ids: str = Field(max_length=1 << 28, description="base64 of uint16 [rows, num_layers, k]")


FinishReason = Literal["stop", "length"]
# strict: a JSON true/false or 1.0 is refused, not coerced to 1/0.
MaskBit = Annotated[int, Field(strict=True, ge=0, le=1)]


class WorkerTrajectory(_Model):
    """One sampled completion as a worker submits it: data to check, never a fact. It has
    no reward (the controller scores the completion text itself) and its prompt ids must
    equal the leased `PromptGroup.prompt_token_ids`.

    A multi-turn episode is one completion: model turns (mask 1) and the environment's
    observation tokens (mask 0) in order, starting and ending with a model turn.
    `completion_mask` (absent = every token is the model's: a single-turn completion) says
    which is which; every token has a log-prob and a version entry, the environment's
    being 0.0 and the version of the turn before (the learner ignores both)."""

    prompt_id: str = Field(max_length=512)
    sample_index: int = Field(ge=0, lt=_MAX_SAMPLES)
    prompt_token_ids: list[int] = Field(max_length=_MAX_TOKENS)
    completion_token_ids: list[int] = Field(min_length=1, max_length=_MAX_TOKENS)
    logprobs: list[float] = Field(
        max_length=_MAX_TOKENS, description="behavior log-prob of each completion token"
    )
    versions: list[int] = Field(
        max_length=_MAX_TOKENS, description="policy version that sampled each completion token"
    )
    finish_reason: FinishReason
    completion_mask: list[MaskBit] | None = Field(
        default=None,
        max_length=_MAX_TOKENS,
        description="1 = sampled by the model (trained), 0 = environment observation",
    )
    routed_experts: RoutedExperts | None = Field(
        default=None,
        description="a MoE policy's recorded routing (required when the run replays it)",
    )

    @property
    def min_version(self) -> int:
        return min(self.versions)

    @property
    def mask(self) -> list[int]:
        """The loss mask of the completion tokens (all ones for a single-turn completion)."""
        if self.completion_mask is None:
            return [1] * len(self.completion_token_ids)
        return list(self.completion_mask)

    def segments(self) -> list[tuple[int, list[int]]]:
        """The completion as runs of equal mask: [(1, model ids), (0, env ids), ...]."""
        ids, mask = self.completion_token_ids, self.completion_mask
        if mask is None:  # a single-turn completion: one model turn
            return [(1, list(ids))] if ids else []
        if len(mask) != len(ids):
            raise ValueError(f"completion_mask has {len(mask)} entries for {len(ids)} tokens")
        # Run boundaries as one array comparison: a per-token loop here was ~20 ms a
        # maximum-length completion of the controller's GIL (docs/design/request-bodies.md).
        m = np.asarray(mask, dtype=np.int64)
        edges = [0, *(np.flatnonzero(m[1:] != m[:-1]) + 1).tolist(), len(ids)]
        return [(int(m[a]), list(ids[a:b])) for a, b in zip(edges, edges[1:], strict=False) if b]


class Trajectory(WorkerTrajectory):
    """A checked trajectory with the controller's own reward (trusted side only, never on
    the wire from a worker): what buffered groups hold and the learner consumes."""

    reward: float
    reward_error: str = Field(default="", description="why scoring failed (reward is then 0)")
    think_tokens: int = Field(default=0, ge=0, description="completion tokens spent thinking")


class GroupResult(_Model):
    group_id: int
    trajectories: list[WorkerTrajectory] = Field(max_length=_MAX_SAMPLES)


class Submission(_Model):
    lease_id: str = Field(max_length=128)
    groups: list[GroupResult] = Field(min_length=1, max_length=_MAX_GROUPS)


class SubmitResponse(_Route):
    """Its route is the one for `announcement`, as in every reply that announces a version:
    a worker that first hears of a version here fetches it on the same route as the rest of
    the fleet (two routes for one version can make two relays wait on each other)."""

    accepted: list[int] = Field(description="group ids newly accepted")
    duplicates: list[int] = Field(description="group ids already accepted before (not recounted)")
    announcement: VersionAnnouncement
    swap_to: int | None = None
    eval_pending: bool = Field(
        default=False, description="as LeaseResponse.eval_pending, for the lease's version"
    )


class Release(_Model):
    lease_id: str = Field(max_length=128)
    reason: str = Field(default="", max_length=1024)


class Ack(_Model):
    ok: bool = True
    detail: str = ""


class ConsumedGroup(_Model):
    """A complete, fresh group handed to the learner (in-process, never on the wire)."""

    group_id: int
    prompt_id: str
    prompt: str
    answer: str
    trajectories: list[Trajectory]
    worker_id: str = Field(default="", description="who generated it (for the audit)")
    engine_dtype: str = Field(
        default="bfloat16", description="the worker's declared engine dtype (its profile)"
    )
    sampling_seed: int = Field(
        default=-1,
        description="the seed its lease carried (bridge/control/leasing/sampling_seeds.py), the "
        "trusted side's own copy; -1: unknown (its tokens cannot be verified)",
    )
