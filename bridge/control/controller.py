"""Controller logic (no HTTP): prompt queue, leases, staleness, admission, fleet accounting.

Served over HTTP by bridge/control/service.py; the learner calls `wait_batch` directly.

Staleness-aware batches and the checkpoint cursor are in bridge/control/learner_api.py
(`LearnerSide`, which the controller holds as `self.learner` and delegates to); every SQL
statement is in bridge/control/db.py; the prompt queue draws from prompt_stream.py.

Admission control. With g = groups_per_step, S the staleness bound, newest published
version P, the learner's next step t and allowed worker lag m (`max_version_lag`): a group
leased with `ahead` groups leased or buffered before it is generated at a version >= P - m
and consumed at step t + floor(ahead / g) (batches go oldest version first, then by
arrival, and later leases are at versions >= its own), so its staleness is at most
(t - P + m) + floor(ahead / g), which is <= S iff ahead < (S + 1 - (t - P) - m) * g. So

    leased + buffered <= max(0, (S + 1 - (t - P) - m) * g)

and a worker more than m versions behind P gets no work, only `swap_to`. A worker whose
last lease came back stale and whose measured lease latency exceeds the time left before
new work would go stale gets no work either (reason "too_slow", bridge/control/lease_timing.py).
Drops stay possible (a worker slowing down mid-lease, restarts) and are counted, never fed
to the learner.

Leases expire `lease_ttl_s` after issue; each heartbeat renews its worker's leases. Expired
or released work goes back to the front of the queue. Submissions are idempotent per group:
a group already accepted is reported as a duplicate and not counted again. All state lives
in SQLite (db.py), one transaction per operation.

Cost: each worker accrues price_per_hour * time alive; time between two contacts counts
when they are at most `worker_timeout_s` apart (idle-but-alive workers are billed too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import secrets
import threading
import time
import uuid
from collections.abc import Callable

from bridge.control.db import ControllerDB
from bridge.control.learner_api import LearnerSide
from bridge.control.lease_timing import LeaseTiming
from bridge.control.prompt_stream import PromptStream
from bridge.control.protocol import (
    ConsumedGroup,
    Heartbeat,
    HeartbeatResponse,
    Lease,
    LeaseRequest,
    LeaseResponse,
    PromptGroup,
    SamplingParams,
    Submission,
    SubmitResponse,
    VersionAnnouncement,
    WorkerProfile,
)
from bridge.control.validation import SubmissionError, check_group
from bridge.tasks import Task


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    staleness: int = 2  # S
    groups_per_step: int = 8  # prompt groups the learner consumes per step
    group_size: int = 4  # samples per prompt (GRPO n)
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    vocab_size: int = 128
    max_prompt_tokens: int = 256
    lease_ttl_s: float = 60.0
    heartbeat_interval_s: float = 5.0
    worker_timeout_s: float = 30.0
    max_groups_per_lease: int = 16
    max_version_lag: int = 0  # m above
    refuse_too_slow: bool = True  # freshness-aware leasing (bridge/control/lease_timing.py)
    retest_slow_after_s: float = 60.0  # a too-slow worker's latency is re-measured this often
    retry_after_s: float = 0.5
    seed: int = 0


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Controller:
    def __init__(
        self,
        config: ControllerConfig,
        db_path: str,
        task: Task,
        clock: Callable[[], float] = time.time,
    ):
        if config.staleness < 0 or config.groups_per_step < 1 or config.group_size < 1:
            raise ValueError(f"bad controller config {config}")
        self.config, self.task, self.clock = config, task, clock
        self.store = ControllerDB(db_path)
        self.lock = threading.RLock()
        self._new_work = threading.Condition(self.lock)
        self.timing = LeaseTiming(config.staleness, config.retest_slow_after_s)
        self._slow_warned: dict[str, float] = {}  # worker -> when it was last reported slow
        self._prompts = PromptStream(task, config.seed, self.store)
        self.learner = LearnerSide(
            self.store, self.lock, config.staleness, clock, self.timing, self._prompts
        )

    def close(self) -> None:
        with self.lock:
            self.store.close()

    @contextlib.contextmanager
    def _op(self):
        """Lock + one transaction: each public operation is atomic and serialized."""
        with self.lock, self.store.tx():
            yield

    # -- versions ------------------------------------------------------------------------
    def publish(self, version: int, store: dict | str | None = None) -> VersionAnnouncement:
        """Announce `version` (call once its manifest is in the weight store `store`)."""
        with self._op():
            cur = self._announcement()
            if version < cur.version:
                raise ValueError(f"version {version} is older than published {cur.version}")
            ann = VersionAnnouncement(version=version, store=store, published_at=self.clock())
            self.store.put("announcement", ann.model_dump())
            return ann

    def announcement(self) -> VersionAnnouncement:
        with self.lock:
            return self._announcement()

    def _announcement(self) -> VersionAnnouncement:
        return VersionAnnouncement(**self.store.get("announcement", {"version": -1}))

    def _swap_to(self, worker_version: int) -> int | None:
        newest = self._announcement().version
        return newest if worker_version < newest else None

    # -- workers -------------------------------------------------------------------------
    def register(self, profile: WorkerProfile) -> tuple[str, str]:
        """A new worker; returns (worker_id, token). Only the token's hash is stored."""
        with self._op():
            worker_id, token, now = (
                f"w-{uuid.uuid4().hex[:12]}",
                secrets.token_urlsafe(32),
                self.clock(),
            )
            self.store.add_worker(worker_id, hash_token(token), profile.model_dump_json(), now)
            self.store.incr("workers/registered")
            return worker_id, token

    def authenticate(self, token: str) -> str | None:
        with self.lock:
            return self.store.worker_by_token(hash_token(token))

    def worker_versions(self) -> list[dict]:
        """Every worker (also those that left): `worker_id`, `version` (the policy version
        it last reported, -1 before its first), `price_per_hour`, `registered_at`."""
        with self.lock:
            return [
                {
                    "worker_id": w["worker_id"],
                    "version": w["version"],
                    "price_per_hour": json.loads(w["profile"])["price_per_hour"],
                    "registered_at": w["registered_at"],
                }
                for w in self.store.workers()
            ]

    def _touch(self, worker_id: str, version: int | None = None, **cols) -> None:
        now, w = self.clock(), self.store.worker(worker_id)
        gap = now - w["last_seen"]
        active_s = w["active_s"] + (gap if 0 < gap <= self.config.worker_timeout_s else 0.0)
        if version is not None:
            cols["version"] = version
        self.store.update_worker(worker_id, last_seen=now, active_s=active_s, **cols)

    def set_worker_enabled(self, worker_id: str, enabled: bool) -> None:
        """Cost-aware activation hook: disabled workers get no leases and are told so."""
        with self._op():
            self.store.update_worker(worker_id, enabled=int(enabled))

    def heartbeat(self, worker_id: str, hb: Heartbeat) -> HeartbeatResponse:
        with self._op():
            now = self.clock()
            self.store.expire_leases(now)
            self._touch(
                worker_id,
                hb.worker_version,
                samples_per_s=hb.samples_per_s,
                tokens_per_s=hb.tokens_per_s,
            )
            renewed = self.store.active_leases(worker_id)
            self.store.renew_leases(worker_id, now + self.config.lease_ttl_s)
            return HeartbeatResponse(
                announcement=self._announcement(),
                swap_to=self._swap_to(hb.worker_version),
                active=bool(self.store.worker(worker_id)["enabled"]),
                renewed_leases=renewed,
            )

    def leave(self, worker_id: str) -> None:
        with self._op():
            for lease_id in self.store.active_leases(worker_id):
                self.store.end_lease(lease_id, "released")
            self._touch(worker_id)
            self.store.update_worker(worker_id, left_at=self.clock())
            self.timing.forget(worker_id)

    # -- leases --------------------------------------------------------------------------
    def admission_capacity(self) -> int:
        """How many groups may be leased + buffered now and still be fresh when consumed."""
        with self.lock:
            c, newest = self.config, self._announcement().version
            if newest < 0:
                return 0
            lag = self.store.get("next_step", 0) - newest
            return max(0, (c.staleness + 1 - lag - c.max_version_lag) * c.groups_per_step)

    def lease(self, worker_id: str, req: LeaseRequest) -> LeaseResponse:
        with self._op():
            c, now = self.config, self.clock()
            self.store.expire_leases(now)
            self.learner.drop_stale(self.store.get("next_step", 0))
            self._touch(worker_id, req.worker_version)
            ann = self._announcement()
            reply = dict(announcement=ann, swap_to=self._swap_to(req.worker_version))
            if ann.version < 0:
                return LeaseResponse(reason="no_version", retry_after_s=c.retry_after_s, **reply)
            if not self.store.worker(worker_id)["enabled"]:
                return LeaseResponse(
                    reason="inactive", retry_after_s=c.heartbeat_interval_s, **reply
                )
            if ann.version - req.worker_version > c.max_version_lag:
                return LeaseResponse(reason="behind", **reply)
            profile = WorkerProfile(**json.loads(self.store.worker(worker_id)["profile"]))
            held = self.store.groups_held(worker_id)
            worker_room = max(1, profile.max_concurrent_sequences // c.group_size) - held
            room = (
                self.admission_capacity()
                - self.store.count("leased")
                - self.store.count("buffered")
            )
            k = min(req.max_groups, c.max_groups_per_lease, room, worker_room)
            if k <= 0:
                return LeaseResponse(reason="full", retry_after_s=c.retry_after_s, **reply)
            if not self._fresh_enough(worker_id, min(req.worker_version, ann.version), now):
                return LeaseResponse(reason="too_slow", retry_after_s=c.retry_after_s, **reply)
            self._refill(k)
            rows = self.store.groups_in("queued", k)
            lease_id = uuid.uuid4().hex
            expires = now + c.lease_ttl_s
            self.store.add_lease(lease_id, worker_id, now, expires)
            self.store.set_state([r["group_id"] for r in rows], "leased", lease_id=lease_id)
            self.store.incr("leases/issued")
            groups = [
                PromptGroup(
                    group_id=r["group_id"],
                    prompt_id=r["prompt_id"],
                    task=self.task.name,
                    task_options=self.task.options,
                    prompt=r["prompt"],
                    answer=r["answer"],
                    n=c.group_size,
                    sampling=c.sampling,
                )
                for r in rows
            ]
            return LeaseResponse(
                lease=Lease(lease_id=lease_id, expires_at=expires, groups=groups), **reply
            )

    def _fresh_enough(self, worker_id: str, version: int, now: float) -> bool:
        """False if this worker's leases come back too late to be fresh (lease_timing.py)."""
        c = self.config
        ok, latency, window = self.timing.fresh_enough(
            worker_id, version, self.store.get("next_step", 0), now
        )
        # A borderline worker flips between fits and does not fit within a step: say it once
        # per re-measuring period, not at every flip.
        if not ok and now - self._slow_warned.get(worker_id, -math.inf) > c.retest_slow_after_s:
            self._slow_warned[worker_id] = now
            logging.warning(
                "worker %s %s: its leases take %.2fs but must be back within %.2fs "
                "(staleness %d at the learner's current pace). It is still billed; raise "
                "staleness or stop it (re-measured every %.0fs).",
                worker_id,
                "gets no work for now" if c.refuse_too_slow else "returns work too late",
                latency,
                window,
                c.staleness,
                c.retest_slow_after_s,
            )
        return ok or not c.refuse_too_slow

    def _refill(self, k: int) -> None:
        short = k - self.store.count("queued")
        if short > 0:
            new = self._prompts.draw(short)
            self.store.add_groups([(p.prompt_id, p.text, p.answer) for p in new])

    def release(self, worker_id: str, lease_id: str, reason: str = "") -> bool:
        """Give a lease back (e.g. its reward failed); its unsubmitted groups requeue now."""
        if reason:  # the worker's own words: the operator's first clue to a broken task
            logging.warning("worker %s released lease %s: %s", worker_id, lease_id, reason)
        with self._op():
            lease = self._own_lease(worker_id, lease_id)
            if lease["state"] != "active":
                return False
            self.store.end_lease(lease_id, "released")
            return True

    def _own_lease(self, worker_id: str, lease_id: str):
        lease = self.store.lease(lease_id)
        if lease is None:
            raise SubmissionError(f"unknown lease {lease_id!r}", 404)
        if lease["worker_id"] != worker_id:
            raise SubmissionError(f"lease {lease_id!r} belongs to another worker", 403)
        return lease

    # -- submissions ---------------------------------------------------------------------
    def submit(self, worker_id: str, sub: Submission) -> SubmitResponse:
        """Validate everything first, then accept atomically; resubmissions are no-ops."""
        with self._op():
            c, now = self.config, self.clock()
            self.store.expire_leases(now)
            self._touch(worker_id)
            lease = self._own_lease(worker_id, sub.lease_id)
            rows = {r["group_id"]: r for r in self.store.groups_of_lease(sub.lease_id)}
            ids = [g.group_id for g in sub.groups]
            if len(set(ids)) != len(ids):
                raise SubmissionError("a group id appears twice in the submission")
            newest = self._announcement().version
            fresh, dups = [], []
            for g in sub.groups:
                row = rows.get(g.group_id)
                if row is None:
                    raise SubmissionError(
                        f"group {g.group_id} is not (or no longer) part of lease "
                        f"{sub.lease_id!r} (state {lease['state']}); it was requeued",
                        409,
                    )
                if row["state"] in ("buffered", "consumed"):
                    dups.append(g.group_id)
                    continue
                check_group(
                    g,
                    prompt_id=row["prompt_id"],
                    n=c.group_size,
                    sampling=c.sampling,
                    vocab_size=c.vocab_size,
                    max_prompt_tokens=c.max_prompt_tokens,
                    newest_version=newest,
                )
                fresh.append(g)
            for g in fresh:
                self.store.buffer_group(
                    g.group_id,
                    [t.model_dump() for t in g.trajectories],
                    min(t.min_version for t in g.trajectories),
                    now,
                )
            if fresh:
                self.store.incr("groups/accepted", len(fresh))
                self.store.incr("trajectories/accepted", c.group_size * len(fresh))
            self.store.incr("groups/duplicate", len(dups))
            if lease["state"] == "active" and not any(
                r["state"] == "leased" for r in self.store.groups_of_lease(sub.lease_id)
            ):
                self.store.set_lease_state(sub.lease_id, "done")
                step = self.store.get("next_step", 0)
                late = any(step - min(t.min_version for t in g.trajectories) > c.staleness
                           for g in fresh)  # fmt: skip
                self.timing.lease_done(worker_id, lease["created_at"], now, late)
            self._new_work.notify_all()
            return SubmitResponse(
                accepted=[g.group_id for g in fresh],
                duplicates=dups,
                announcement=self._announcement(),
                swap_to=self._swap_to(self.store.worker(worker_id)["version"]),
            )

    # -- the learner (bridge/control/learner_api.py) -------------------------------------
    def take_batch(self, step: int, num_groups: int) -> tuple[list[ConsumedGroup] | None, dict]:
        """`num_groups` fresh groups for `step`, oldest version first; None if too few yet.
        The stats are the fleet metrics, plus the batch's staleness when there is one."""
        with self._op():
            batch, staleness = self.learner.take_batch(step, num_groups)
            return batch, {**self._stats(), **staleness}

    def wait_batch(
        self, step: int, num_groups: int, timeout_s: float
    ) -> tuple[list[ConsumedGroup] | None, dict]:
        """Block until `take_batch` succeeds or `timeout_s` passes (wall clock)."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while True:
                batch, stats = self.take_batch(step, num_groups)
                left = deadline - time.monotonic()
                if batch is not None or left <= 0:
                    return batch, stats
                # Wake on submissions; poll anyway so lease expiry is noticed.
                self._new_work.wait(min(left, 0.5))

    def export_cursor(self) -> dict:
        return self.learner.export_cursor()

    def restore_cursor(self, cursor: dict) -> int:
        return self.learner.restore_cursor(cursor)

    def forget_consumed(self, up_to_step: int) -> int:
        return self.learner.forget_consumed(up_to_step)

    # -- metrics -------------------------------------------------------------------------
    def stats(self) -> dict:
        with self._op():
            self.store.expire_leases(self.clock())
            return self._stats()

    def _stats(self) -> dict:
        now, s = self.clock(), self.store
        workers = s.workers()
        alive = [
            w
            for w in workers
            if w["left_at"] is None and now - w["last_seen"] <= self.config.worker_timeout_s
        ]
        cost = sum(json.loads(w["profile"])["price_per_hour"] * w["active_s"] for w in workers)
        out = {
            "fleet/active_workers": sum(1 for w in alive if w["enabled"]),
            "fleet/rollouts_per_s": sum(w["samples_per_s"] for w in alive if w["enabled"]),
            "fleet/too_slow_workers": sum(
                1 for w in alive if w["worker_id"] in self.timing.too_slow
            ),
            "cost/usd": cost / 3600.0,
            "policy_version/published": self._announcement().version,
            "admission/capacity": self.admission_capacity(),
        }
        for state in ("queued", "leased", "buffered"):
            out[f"groups/{state}"] = s.count(state)
        for key in (
            "staleness/dropped",
            "groups/accepted",
            "groups/consumed",
            "groups/duplicate",
            "trajectories/accepted",
            "leases/issued",
            "leases/expired",
            "leases/released",
        ):
            out[key] = s.get(key, 0)
        return out
