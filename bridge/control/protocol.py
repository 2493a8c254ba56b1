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
    GET  /v1/status                     ->   controller stats (dict)

Every call but /v1/register sends `Authorization: Bearer <worker token>`.

Versions: a policy version is the learner step whose parameters generated a token
(version v = weights after v updates). A trajectory tags every completion token with
its version, so a hot swap in the middle of a generation is visible; the staleness of a
trajectory is judged by its oldest token.
"""

from __future__ import annotations

from typing import Any, Literal

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


class RegisterResponse(_Model):
    worker_id: str
    token: str
    heartbeat_interval_s: float
    lease_ttl_s: float
    announcement: VersionAnnouncement


class Heartbeat(_Model):
    worker_version: int = Field(ge=-1, description="the policy version the worker now serves")
    samples_per_s: float = Field(default=0.0, ge=0.0, le=1e9, description="measured")
    tokens_per_s: float = Field(default=0.0, ge=0.0, le=1e12, description="measured")
    active_sequences: int = Field(default=0, ge=0, le=1 << 24)


class HeartbeatResponse(_Model):
    announcement: VersionAnnouncement
    swap_to: int | None = Field(default=None, description="swap to this version first")
    active: bool = Field(default=True, description="false: the fleet does not need you now")
    renewed_leases: list[str] = Field(default_factory=list)


class SamplingParams(_Model):
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    max_tokens: int = Field(default=16, ge=1, le=_MAX_TOKENS)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)


class PromptGroup(_Model):
    """One prompt to sample `n` completions of (a GRPO group)."""

    group_id: int
    prompt_id: str
    task: str
    task_options: dict[str, Any] = Field(
        default_factory=dict, description="rebuild the reward with tasks.cached_task(task, options)"
    )
    prompt: str
    answer: str = Field(description="reference the task's reward function compares against")
    n: int = Field(ge=1, le=_MAX_SAMPLES)
    sampling: SamplingParams


class LeaseRequest(_Model):
    worker_version: int = Field(ge=-1)
    max_groups: int = Field(default=1, ge=1, le=_MAX_GROUPS)


class Lease(_Model):
    lease_id: str
    expires_at: float = Field(description="controller clock; heartbeats renew it")
    groups: list[PromptGroup]


class LeaseResponse(_Model):
    lease: Lease | None = None
    reason: Literal["ok", "behind", "full", "no_version", "inactive", "empty", "too_slow"] = "ok"
    retry_after_s: float = 0.0
    announcement: VersionAnnouncement
    swap_to: int | None = None


FinishReason = Literal["stop", "length"]


class Trajectory(_Model):
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
    reward: float
    finish_reason: FinishReason

    @property
    def min_version(self) -> int:
        return min(self.versions)


class GroupResult(_Model):
    group_id: int
    trajectories: list[Trajectory] = Field(max_length=_MAX_SAMPLES)


class Submission(_Model):
    lease_id: str = Field(max_length=128)
    groups: list[GroupResult] = Field(min_length=1, max_length=_MAX_GROUPS)


class SubmitResponse(_Model):
    accepted: list[int] = Field(description="group ids newly accepted")
    duplicates: list[int] = Field(description="group ids already accepted before (not recounted)")
    announcement: VersionAnnouncement
    swap_to: int | None = None


class Release(_Model):
    lease_id: str = Field(max_length=128)
    reason: str = Field(default="", max_length=1024)


class Ack(_Model):
    ok: bool = True
    detail: str = ""


class ConsumedGroup(_Model):
    """A complete, fresh group handed to the learner."""

    group_id: int
    prompt_id: str
    prompt: str
    answer: str
    trajectories: list[Trajectory]
