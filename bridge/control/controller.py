"""Controller logic (no HTTP): prompt queue, leases, staleness, admission, fleet accounting.

Served over HTTP by bridge/control/service.py; the learner calls `wait_batch` directly.

Staleness-aware batches and the checkpoint cursor are in bridge/control/learner_api.py
(`LearnerSide`, which the controller holds as `self.learner` and delegates to); every SQL
statement is in bridge/control/db.py; the prompt queue draws from prompt_stream.py.

Admission control. With g = groups_per_step, S the staleness bound, the learner's next step
t and a lease generated at version x (the worker's own, at most the newest published P): a
group leased with `ahead` groups leased or buffered before it is consumed at step
t + floor(ahead / g) at the latest (batches go oldest version first, then by arrival), so
its staleness is at most (t - x) + floor(ahead / g), which is <= S iff
ahead < (S + 1 - (t - x)) * g. So a lease at version x may bring leased + buffered up to

    max(0, (S + 1 - (t - x)) * g)

Counting every outstanding group, also newer ones it will overtake, keeps the groups
admitted earlier fresh too: for a group at v > x the same sum is below its own, looser bound.
A worker more than m (`max_version_lag`) versions behind P gets no work, only `swap_to`,
except one fetching P in the background (peer broadcast, `fetching_version`) or unable to
load it (`unloadable_version`), which works one version behind: the broadcast overlaps
generation instead of idling the worker (the planner's "held" admission). A worker whose
last lease came back stale and whose measured lease latency exceeds the time left before
new work would go stale gets no work either (reason "too_slow", bridge/control/lease_timing.py).
Drops stay possible (a worker slowing down mid-lease, restarts) and are counted, never fed
to the learner.

Leases expire `lease_ttl_s` after issue; each heartbeat renews its worker's leases. Expired
or released work goes back to the front of the queue. Submissions are idempotent per group:
a group already accepted is reported as a duplicate and not counted again. All state lives
in SQLite (db.py), one transaction per operation.

Run end (bridge/control/run_end.py, `self.run_end`): after `end_run()` every poll answers
`run_over`, and `wait_run_over_seen` drains until every live worker heard it. `status()` is
the fleet table of `python -m bridge.status` (bridge/control/fleet_status.py).

Cost: each worker accrues price_per_hour * time alive; time between two contacts counts
when they are at most `worker_timeout_s` apart (idle-but-alive workers are billed too),
standby time at `standby_price_fraction` of the price.

Capacity and activation (bridge/control/fleet_plan.py, `self.fleet`): the capacity model on
measured inputs goes into every batch's stats; with `activation` on, the cheapest set of
workers that covers the learner's need is active, the others are told `active=false` and
get no leases (reason "inactive").

Trust: the controller builds each leased prompt's token ids itself (`codec`, the run's
tokenizer) and refuses a group generated from other ids; it scores every completion itself
(bridge/control/rewards.py, outside the lock, a timeout per call; a multi-turn episode by
replaying its environment) and never sends reference answers out; `audit` quarantines a
worker whose behaviour log-probs stray from the learner's (bridge/control/audit.py).

Weight broadcast (bridge/broadcast/state.py, `self.broadcast`, config `broadcast`): relay
routes in every heartbeat/lease answer, bad-parent reports, `broadcast/*` metrics.

Abuse limits (bridge/control/limits.py): per-worker request rates (`self.limits`, enforced
by the service), at most `max_leases_per_worker` active leases per worker (reason
"lease_limit"), and tokens that die `token_ttl_s` after their worker's last contact.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from bridge.broadcast.state import BroadcastState
from bridge.control import audit as audit_lib
from bridge.control import fleet_status, intake, limits, rollback
from bridge.control.config import ControllerConfig
from bridge.control.db import ControllerDB
from bridge.control.fleet_plan import FleetPlan
from bridge.control.learner_api import LearnerSide
from bridge.control.lease_content import LeaseContent
from bridge.control.lease_timing import LeaseTiming
from bridge.control.prompt_stream import PromptStream
from bridge.control.protocol import (
    ConsumedGroup,
    Heartbeat,
    HeartbeatResponse,
    Lease,
    LeaseRequest,
    LeaseResponse,
    Submission,
    SubmitResponse,
    VersionAnnouncement,
    WorkerProfile,
)
from bridge.control.rewards import CallPool, Codec, RewardScorer
from bridge.control.run_end import RunEnd
from bridge.control.validation import SubmissionError
from bridge.tasks import Task

# Cumulative counters (db.incr) reported in every stats line.
_COUNTERS = """staleness/dropped groups/accepted groups/consumed groups/duplicate
trajectories/accepted leases/issued leases/expired leases/released reward/errors
reward/timeouts fleet/quarantined audit/dropped_groups""".split()


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class Controller:
    def __init__(
        self,
        config: ControllerConfig,
        db_path: str,
        task: Task,
        clock: Callable[[], float] = time.time,
        *,
        codec: Codec | None = None,
        reward_pool: CallPool | None = None,
    ):
        """`codec` (bridge.contracts.prompt.TextCodec of the run's HF dir) builds prompt ids
        and decodes completions for scoring; without one the controller cannot lease (tests
        of other parts only). `reward_pool`: default `bridge.tasks.reward_pool.default_pool`."""
        if config.staleness < 0 or config.groups_per_step < 1 or config.group_size < 1:
            raise ValueError(f"bad controller config {config}")
        self.config, self.task, self.clock = config, task, clock
        self.store = ControllerDB(db_path)
        self.lock = threading.RLock()
        self._new_work = threading.Condition(self.lock)
        self.timing = LeaseTiming(
            config.staleness, config.retest_slow_after_s, config.refuse_too_slow
        )
        self._prompts = PromptStream(task, config.seed, self.store)
        self.fleet = FleetPlan(config, self.store, self.timing, clock)
        self.learner = LearnerSide(
            self.store, self.lock, config.staleness, clock, self.timing, self._prompts
        )
        self.codec = codec
        self.content = LeaseContent(config, task, codec)
        self.scorer = None if codec is None else RewardScorer(
            task, codec, config.reward_timeout_s, reward_pool
        )  # fmt: skip
        self._unloadable_logged: set[int] = set()  # versions a worker reported it cannot load
        self.limits = limits.Limits(config)  # request rates, enforced by service.py
        self.run_end = RunEnd(self.store, config, clock)
        with self._op():  # a controller that starts serves a live run: a resumed run's
            self.run_end.clear()  # old end must not send workers home
        self.broadcast = BroadcastState(
            config.broadcast,
            config.broadcast_fanout,
            config.broadcast_bad_limit,
            config.worker_timeout_s,
        )
        self.auditor = audit_lib.WorkerAudit(
            audit_lib.AuditConfig(
                config.audit_kl_threshold,
                config.audit_logratio_threshold,
                config.audit_min_tokens,
                config.audit_window_tokens,
            )
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
            self.fleet.published(version, ann.published_at)
            self.broadcast.publish(version, ann.published_at)
            return ann

    def announcement(self) -> VersionAnnouncement:
        with self.lock:
            return self._announcement()

    def _announcement(self) -> VersionAnnouncement:
        return VersionAnnouncement(**self.store.get("announcement", {"version": -1}))

    def _swap_to(self, worker_version: int) -> int | None:
        """The version a worker must load first: the newest, when it serves another one.
        A worker AHEAD of the newest holds a version a crashed learner rolled back (the rerun
        republishes that number with other weights), so it is sent back too."""
        newest = self._announcement().version
        return newest if newest >= 0 and worker_version != newest else None

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
            self.fleet.replan(now, force=True)
            return worker_id, token

    def authenticate(self, token: str) -> str | None:
        with self.lock:
            row = self.store.worker_by_token(hash_token(token), with_last_seen=True)
            alive = row and limits.token_alive(row[1], self.clock(), self.config.token_ttl_s)
            return row[0] if alive else None

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

    def _behind(self, worker_id: str, req: LeaseRequest, newest: int) -> bool:
        """More than `max_version_lag` versions behind the newest. A newest version the
        worker is fetching in the background (a relay hop, a WAN download) does not count:
        it keeps generating on its own version meanwhile, admitted at that version. Nor does
        one it could not load (corrupt in the store: a worker verifies every chunk): it keeps
        generating until the learner publishes the next one. Without this one corrupt
        version stalled the learner: every worker was refused work for being behind."""
        lag = newest - req.worker_version
        if req.fetching_version == newest >= 0:
            lag -= 1
        elif req.unloadable_version == newest >= 0:
            lag -= 1
            if newest not in self._unloadable_logged:
                self._unloadable_logged.add(newest)
                logging.warning(
                    "worker %s cannot load version %d (corrupt in the store?); workers keep "
                    "generating on older versions within the staleness bound",
                    worker_id,
                    newest,
                )
        return lag > self.config.max_version_lag

    def broadcast_fetches(self) -> list[dict]:
        """Each worker's reported fetch of each recent version (bridge/broadcast/state.py)."""
        return self.broadcast.fetches()

    def _touch(self, worker_id: str, version: int | None = None, **cols) -> None:
        now, w = self.clock(), self.store.worker(worker_id)
        gap = now - w["last_seen"]
        billed = 0 < gap <= self.config.worker_timeout_s
        if billed:
            self.fleet.accrue(worker_id, w["last_seen"], now)
        if version is not None:
            cols["version"] = version
            if version > w["version"]:
                self.fleet.swapped(worker_id, version, now)
        active_s = w["active_s"] + (gap if billed else 0.0)
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
            self.broadcast.heartbeat(worker_id, hb, now)
            renewed = self.store.active_leases(worker_id)
            self.store.renew_leases(worker_id, now + self.config.lease_ttl_s)
            self.fleet.replan(now)
            return HeartbeatResponse(
                announcement=self._announcement(),
                swap_to=self._swap_to(hb.worker_version),
                active=self._active(worker_id),
                run_over=self.run_end.tell(worker_id),
                renewed_leases=renewed,
                **self.broadcast.route(worker_id, self._announcement().version),
            )

    def leave(self, worker_id: str) -> None:
        with self._op():
            for lease_id in self.store.active_leases(worker_id):
                self.store.end_lease(lease_id, "released")
            self._touch(worker_id)
            self.store.update_worker(worker_id, left_at=self.clock())
            self.timing.forget(worker_id)
            self.fleet.forget(worker_id)
            self.broadcast.leave(worker_id)
            self.fleet.replan(self.clock(), force=True)

    def _active(self, worker_id: str) -> bool:
        """Enabled (not switched off by hand) and not on standby (fleet_plan.py)."""
        return bool(self.store.worker(worker_id)["enabled"]) and self.fleet.is_active(worker_id)

    # -- leases --------------------------------------------------------------------------
    def admission_capacity(self, version: int | None = None) -> int:
        """How many groups may be leased + buffered now and still be fresh when consumed, for
        a lease generated at `version` (default and at most: the newest published)."""
        with self.lock:
            c, newest = self.config, self._announcement().version
            if newest < 0:
                return 0
            x = newest if version is None else min(version, newest)
            lag = self.store.get("next_step", 0) - x
            return max(0, (c.staleness + 1 - lag) * c.groups_per_step)

    def lease(self, worker_id: str, req: LeaseRequest) -> LeaseResponse:
        with self._op():
            c, now = self.config, self.clock()
            self.store.expire_leases(now)
            self.learner.drop_stale(self.store.get("next_step", 0))
            self._touch(worker_id, req.worker_version)
            ann = self._announcement()
            reply = dict(
                announcement=ann,
                swap_to=self._swap_to(req.worker_version),
                **self.broadcast.route(worker_id, ann.version),
            )
            if self.run_end.tell(worker_id):
                return LeaseResponse(reason="run_over", retry_after_s=c.retry_after_s, **reply)
            if ann.version < 0:
                return LeaseResponse(reason="no_version", retry_after_s=c.retry_after_s, **reply)
            if not self._active(worker_id):
                return LeaseResponse(
                    reason="inactive", retry_after_s=c.heartbeat_interval_s, **reply
                )
            if self._behind(worker_id, req, ann.version):
                return LeaseResponse(reason="behind", **reply)
            if len(self.store.active_leases(worker_id)) >= c.max_leases_per_worker > 0:
                return LeaseResponse(reason="lease_limit", retry_after_s=c.retry_after_s, **reply)
            profile = WorkerProfile(**json.loads(self.store.worker(worker_id)["profile"]))
            held = self.store.groups_held(worker_id)
            worker_room = max(1, profile.max_concurrent_sequences // c.group_size) - held
            version, step = min(req.worker_version, ann.version), self.store.get("next_step", 0)
            room = (
                self.admission_capacity(version)
                - self.store.count("leased")
                - self.store.count("buffered")
            )
            k = min(req.max_groups, c.max_groups_per_lease, room, worker_room)
            if k <= 0:
                return LeaseResponse(reason="full", retry_after_s=c.retry_after_s, **reply)
            if not self.timing.admit(worker_id, version, step, now):
                return LeaseResponse(reason="too_slow", retry_after_s=c.retry_after_s, **reply)
            self._refill(k)
            rows = self.store.groups_in("queued", k)
            lease_id = uuid.uuid4().hex
            expires = now + c.lease_ttl_s
            self.store.add_lease(lease_id, worker_id, now, expires)
            self.store.set_state([r["group_id"] for r in rows], "leased", lease_id=lease_id)
            self.store.incr("leases/issued")
            groups = [self.content.group(r) for r in rows]
            return LeaseResponse(
                lease=Lease(lease_id=lease_id, expires_at=expires, groups=groups), **reply
            )

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
        """Check everything, score the completions outside the lock (rewards.py), then
        accept atomically; resubmissions are no-ops."""
        with self._op():
            fresh, prompts = intake.check_submission(self, worker_id, sub)
        scored = [
            (g.group_id, *self.scorer.score_group(g.group_id, prompts[g.group_id], g.trajectories))
            for g in fresh
        ]
        with self._op():
            return intake.accept(self, worker_id, sub, scored)

    # -- behaviour log-prob audit (bridge/control/audit.py) ------------------------------
    def audit(self, stats: Sequence[audit_lib.AuditStat]) -> list[str]:
        """Fold in the learner's per-worker comparison of behaviour and learner log-probs
        (`audit.rows_to_worker_stats`, after each step); returns the workers quarantined now:
        token revoked, leases ended, buffered groups requeued."""
        with self._op():
            out = []
            for st in stats:
                why = self.auditor.add(st)
                w = self.store.worker(st.worker_id)
                if why and w is not None and not w["token_hash"].startswith("quarantined:"):
                    audit_lib.quarantine(self.store, st.worker_id, why, self.clock())
                    self.timing.forget(st.worker_id)
                    self.fleet.forget(st.worker_id)
                    out.append(st.worker_id)
            self.store.incr("audit/tokens", sum(st.tokens for st in stats))
            if out:
                self.fleet.replan(self.clock(), force=True)
            return out

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

    def report_learner(self, step_s: float | None = None, publish_s: float | None = None):
        """The learner's train time of its last update (T for the capacity model; until it
        reports, the measured step period, waits included) and, on publishing steps, the
        time to publish (0 or None: none this step). Call after each RL step."""
        with self.lock:
            self.fleet.learner_reported(step_s, publish_s)

    def export_cursor(self) -> dict:
        return self.learner.export_cursor()

    def restore_cursor(self, cursor: dict, version: int | None = None) -> int:
        """Put the groups consumed after a checkpoint back in the buffer; with `version`
        (the checkpoint's), also undo what a crashed run did past it (control/rollback.py)."""
        back = self.learner.restore_cursor(cursor)
        if version is not None:
            with self._op():
                rollback.roll_back(self.store, version)
        return back

    def forget_consumed(self, up_to_step: int) -> int:
        return self.learner.forget_consumed(up_to_step)

    # -- run end -------------------------------------------------------------------------
    def end_run(self, reason: str = "finished") -> None:
        """Training is over: from now on every worker that polls is told to leave."""
        with self._op():
            self.run_end.end(reason)

    def workers_told_run_over(self) -> bool:
        """True once every live worker was answered run_over since `end_run` (run_end.py)."""
        with self._op():
            return self.run_end.all_told()

    def wait_run_over_seen(self, timeout_s: float) -> bool:
        """Poll `workers_told_run_over` until true or `timeout_s` passes (wall clock): the
        drain between `end_run()` and stopping the server."""
        deadline = time.monotonic() + timeout_s
        while not self.workers_told_run_over():
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return True

    def status(self) -> dict:
        """The fleet table and the run's step, staleness and spend (fleet_status.py)."""
        with self._op():
            self.store.expire_leases(self.clock())
            return fleet_status.fleet_status(self, self._stats())

    # -- metrics -------------------------------------------------------------------------
    def stats(self) -> dict:
        with self._op():
            self.store.expire_leases(self.clock())
            return self._stats()

    def _stats(self) -> dict:
        now, s = self.clock(), self.store
        out = {
            **self.fleet.stats(now, s.get("trajectories/accepted", 0)),
            "policy_version/published": self._announcement().version,
            "admission/capacity": self.admission_capacity(),
            **self.limits.stats(),
            **self.broadcast.stats(now),
        }
        for state in ("queued", "leased", "buffered"):
            out[f"groups/{state}"] = s.count(state)
        for key in _COUNTERS:
            out[key] = s.get(key, 0)
        return out
