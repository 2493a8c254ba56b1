"""Controller: the one place where the controller's parts are built and wired (no HTTP).

Served over HTTP by bridge/control/http/service.py; the learner calls `wait_batch` directly.
Each public operation takes the lock and one SQLite transaction (`_op`), then calls the
parts; the parts own their state, take what they need in their constructors and never
reference the controller (prime-rl's orchestrator is the model):

- `db` (state/db.py, `ControllerDB`): every table and SQL statement; all durable state.
- `versions` (state/versions.py): the announced policy version and who must swap.
- `workers` (fleet/workers.py): registration, tokens, liveness, billing.
- `leasing` (leasing/leasing.py): admission, the reasons for no work, issuing leases. The
  staleness rule itself (admission cap, freshness, deadlines) is bridge/contracts/staleness.py.
- `intake` (intake/intake.py): a submission checked, scored outside the lock (`scorer`,
  intake/rewards.py), then accepted atomically; resubmissions are no-ops.
- `learner` (learner_api.py): staleness-aware batches, the wait for one, the checkpoint
  cursor; the learner's calls (`take_batch`, `wait_batch`, `report_learner`, the cursor,
  the eval board's learner side) are methods here, so a controller in its own process
  (process.py) serves every one of them.
- `auditor` (trust/audit.py): the log-prob audit and quarantine, kept in the database.
- `timing` (leasing/lease_timing.py): the step period and per-worker lease latency ("too_slow").
- `fleet` (fleet/fleet_plan.py): capacity model on measured inputs and cost-aware activation
  (with `activation` on, workers off the cheapest covering set get reason "inactive").
- `broadcast` (bridge/broadcast/state.py): relay routes in every heartbeat/lease answer.
- `run_end` (fleet/run_end.py): after `end_run()` every poll answers `run_over`; `limits`
  (trust/limits.py): per-worker request rates, lease counts ("lease_limit"), token lifetimes.
- `evals` (evaluation/eval_leases.py): evaluation leases, only to capacity rollouts leave idle.
- `episodes` (intake/episode_steps.py): a multi-turn episode's next observation, turn by turn.
Leases expire `lease_ttl_s` after issue, renewed by heartbeats; expired or released work goes
back to the front of the queue. A heartbeat takes no lock and no SQLite (state/hot_state.py).

Trust: the controller builds each leased prompt's token ids itself (`codec`) and refuses
a group generated from other ids; it scores every completion itself, never sends reference
answers out; `audit` quarantines a worker whose log-probs stray from the learner's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence

from bridge.broadcast.report_check import ReportChecker, probe_uplink
from bridge.broadcast.state import BroadcastState
from bridge.control.config import ControllerConfig
from bridge.control.evaluation.eval_leases import EvalBoard, eval_idle
from bridge.control.fleet import fleet_status
from bridge.control.fleet.fleet_plan import FleetPlan
from bridge.control.fleet.heartbeat_pacing import HeartbeatPacing
from bridge.control.fleet.run_end import RunEnd
from bridge.control.fleet.run_end import wait_all_told as run_end_wait
from bridge.control.fleet.stats_line import stats_line
from bridge.control.fleet.workers import WorkerRegistry
from bridge.control.intake.episode_steps import EpisodeSteps
from bridge.control.intake.intake import Intake, own_lease
from bridge.control.intake.rewards import CallPool, Codec, RewardScorer
from bridge.control.learner_api import LearnerSide, build_batch
from bridge.control.leasing.auto_staleness import AutoStaleness, KlReport
from bridge.control.leasing.lease_content import LeaseContent
from bridge.control.leasing.lease_timing import LeaseTiming
from bridge.control.leasing.leasing import Grant, Leasing
from bridge.control.leasing.liveness import Liveness
from bridge.control.leasing.prompt_stream import PromptStream
from bridge.control.leasing.sampling_seeds import SamplingSeeds
from bridge.control.protocol import (
    ConsumedGroup,
    EpisodeStep,
    EpisodeStepResponse,
    Heartbeat,
    HeartbeatResponse,
    LeaseRequest,
    LeaseResponse,
    Submission,
    SubmitResponse,
    VersionAnnouncement,
    WorkerProfile,
)
from bridge.control.state import rollback
from bridge.control.state.db import ControllerDB
from bridge.control.state.hot_state import HotFlusher
from bridge.control.state.versions import VersionBoard
from bridge.control.trust import audit as audit_lib
from bridge.control.trust import limits
from bridge.control.trust.identity import IdentityBook
from bridge.tasks import Prompt, Task


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
        c = config
        self.config, self.task, self.clock, self.codec = c, task, clock, codec
        self.db = ControllerDB(db_path)
        self.lock = threading.RLock()
        self.timing = LeaseTiming(c.staleness, c.retest_slow_after_s, c.refuse_too_slow)
        prompts = PromptStream(task, c.seed, self.db)
        self.fleet = FleetPlan(c, self.db, self.timing, clock)
        self.versions = VersionBoard(self.db, clock)
        self.workers = WorkerRegistry(self.db, c, clock, self.fleet)
        self.content = LeaseContent(c, task, codec, SamplingSeeds.for_db(self.db))
        self.evals = EvalBoard(c, task.name, self.content)  # eval leases (eval_leases.py)
        self.leasing = Leasing(
            self.db, c, clock, self.timing, prompts, self.content, self.fleet.held_back
        )
        self.intake = Intake(self.db, c, clock, self.content)
        self.learner = LearnerSide(self.db, self.lock, c.staleness, clock, self.timing, prompts)
        self.scorer = None if codec is None else RewardScorer(
            task, codec, c.reward_timeout_s, reward_pool
        )  # fmt: skip
        self.limits = limits.Limits(c)  # request rates, enforced by service.py
        self.run_end = RunEnd(self.db, c, clock)
        with self._op():  # a controller that starts serves a live run: a resumed run's
            self.run_end.clear()  # old end must not send workers home
        self.broadcast = BroadcastState(
            c.broadcast, c.broadcast_fanout, c.broadcast_bad_limit, c.worker_timeout_s,
            checker=None if c.broadcast == "store" else ReportChecker(),
            prober=None if c.broadcast == "store" else ReportChecker(probe_uplink, 8),
        )  # fmt: skip
        self.pacing = HeartbeatPacing(c)  # the interval each reply carries
        self._publish_listeners: list[Callable[[], None]] = []
        self.auditor = audit_lib.WorkerAudit.from_config(c, self.db)
        self.liveness = Liveness(c.staleness, c.groups_per_step, c.max_version_lag, clock())
        self.episodes = EpisodeSteps(
            self.db, self.lock, c, self.content, codec, self.scorer, self.evals
        )
        self.db.restore_deadlines(clock() + c.lease_ttl_s)  # granted: a full TTL more
        self._closed = False
        self._flusher = HotFlusher(self.flush_hot, c.hot_flush_s) if c.hot_flush_s > 0 else None
        self._step_wait = (None, 0.0)  # (learner step, its wait so far): auto S's evidence
        self.auto_staleness = (
            AutoStaleness(c.staleness_min, c.staleness_max, c.staleness, kl_max=c.staleness_kl_max)
            if c.staleness_auto
            else None
        )
        self._last_batch: tuple[float, int] | None = None  # its mean lag and S: the KL's context
        self._kl: KlReport | None = None  # the learner's report on it, until auto S reads it

    def set_staleness(self, s: int) -> None:
        """Move the bound S (`staleness="auto"`, leasing/auto_staleness.py) in every part that
        reads it, at once under the lock: admission, the drop rule, the late check, the
        lease deadline, liveness and the capacity advice."""
        with self.lock:
            if s == self.config.staleness:
                return
            logging.info("staleness bound %d -> %d", self.config.staleness, s)
            self.config = dataclasses.replace(self.config, staleness=s)
            for part in (self.leasing, self.intake, self.fleet):
                part.config = self.config
            self.timing.staleness = self.learner.staleness = s
            self.liveness.staleness = self.fleet.advice.staleness = s

    def close(self) -> None:
        if self._flusher is not None:
            self._flusher.stop()
        with self.lock:
            if self._closed:
                return
            self._closed = True
            with self.db.tx():
                self._persist_hot()
            self.db.close()

    def flush_hot(self, expire: bool = True) -> None:
        """Persist the hot state and end the leases past their deadline (hot_state.py)."""
        with self._op(durable=False):
            self._persist_hot()
            self.db.expire_leases(self.clock() if expire else -math.inf)  # -inf: none past

    def _persist_hot(self) -> None:
        """Write the hot state (lock held, in a transaction) before tables are read."""
        self.workers.persist()
        self.fleet.persist()
        self.db.persist_deadlines()

    def _replan(self) -> None:  # join, leave, quarantine: re-solve on the written hot state
        if self.config.activation:  # else the solve reads nothing: skip the writes too
            self._persist_hot()
            self.fleet.replan(self.clock(), force=True)

    @contextlib.contextmanager
    def _op(self, durable: bool = True):
        """Lock + one transaction: each public operation is atomic and serialized. Then,
        outside the lock, `durable` waits until the transaction is on disk (group commit,
        bridge/control/state/group_commit.py): what is acknowledged survives a power cut."""
        with self.lock, self.db.tx():
            for worker_id, version, at in self.workers.hot.take_swaps():  # from heartbeats
                self.fleet.swapped(worker_id, version, at)
            yield
        if durable and not self.db.conn.in_transaction:  # nested: the outer op syncs
            self.db.sync()

    # -- versions ------------------------------------------------------------------------
    def publish(
        self, version: int, store: dict | str | None = None, manifest_sha256: str | None = None
    ) -> VersionAnnouncement:
        """Announce `version` (call once its manifest is in the weight store `store`), with
        its manifest's SHA-256 (given, or read here from a store on this machine's disk), so
        every worker can refuse a manifest that differs, whoever hands it one."""
        sha = manifest_sha256 or _local_manifest_sha256(store, version)
        with self._op():
            ann = self.versions.publish(version, store, sha)
            self.liveness.published(version)
            self.fleet.published(version, ann.published_at)
            self.broadcast.publish(version, ann.published_at, ann.store)
        for listener in self._publish_listeners:
            listener()
        return ann

    def on_publish(self, listener: Callable[[], None]) -> None:
        """Call `listener()` after every announcement, on the publishing thread: the HTTP
        service answers its held heartbeats (http/version_news.py)."""
        self._publish_listeners.append(listener)

    def announced_at(self) -> float:
        """`published_at` of the announced version; no lock (read as `heartbeat` reads it)."""
        return self.versions.current().published_at

    def announcement(self) -> VersionAnnouncement:
        with self.lock:
            return self.versions.current()

    def unloadable_version(self) -> int:
        """The newest version if a worker reported it cannot load it since it was last
        announced (liveness.py): the learner publishes it again. -1: none."""
        with self.lock:
            return self.liveness.unloadable(self.versions.current().version)

    # -- workers -------------------------------------------------------------------------
    def register(self, profile: WorkerProfile, identity: str | None = None) -> tuple[str, str]:
        """A new worker of `identity` (identity.py; 403 if quarantined): (worker_id, token)."""
        with self._op():
            worker_id, token = self.workers.register(profile, identity)
            self._replan()
            return worker_id, token

    def authenticate(self, token: str) -> str | None:
        # No lock, no SQLite: the token map is in memory (hot_state.py).
        return self.workers.authenticate(token)

    def worker_versions(self) -> list[dict]:
        """Every worker (also those that left): `worker_id`, `version` (the policy version
        it last reported, -1 before its first), `price_per_hour`, `registered_at`."""
        with self._op(durable=False):
            self._persist_hot()
            return self.workers.versions()

    def broadcast_fetches(self) -> list[dict]:
        """Each worker's reported fetch of each recent version (bridge/broadcast/state.py)."""
        return self.broadcast.fetches()

    def set_worker_enabled(self, worker_id: str, enabled: bool) -> None:
        """Cost-aware activation hook: disabled workers get no leases and are told so."""
        with self._op():
            self.workers.set_enabled(worker_id, enabled)

    def heartbeat(self, worker_id: str, hb: Heartbeat) -> HeartbeatResponse:
        """Liveness, gauges and lease renewals in memory (hot_state.py): no lock, no SQLite;
        a crash may lose the last `hot_flush_s` of it. Only a heartbeat that finds the
        activation solve due (at most every `activation_period_s`) runs it, under the lock."""
        now = self.clock()
        gauges = dict(samples_per_s=hb.samples_per_s, tokens_per_s=hb.tokens_per_s)
        self.workers.touch(worker_id, hb.worker_version, **gauges)
        self.broadcast.heartbeat(worker_id, hb, now)
        renewed = self.leasing.renew(worker_id, now)  # up to an age cap (lease_caps.py)
        if self.fleet.replan_due(now):
            with self._op(durable=False):
                self._persist_hot()
                self.fleet.replan(now)
        ann = self.versions.current()
        self.liveness.claimed(worker_id, hb.worker_version, hb.unloadable_version, ann.version)
        return HeartbeatResponse(
            announcement=ann,
            swap_to=self.versions.swap_to(hb.worker_version),
            active=self.workers.is_active(worker_id),
            run_over=self.run_end.tell(worker_id),
            renewed_leases=renewed,
            heartbeat_interval_s=self.heartbeat_interval(worker_id, now),
            **self.broadcast.route(worker_id, ann.version),
        )

    def heartbeat_takes_lock(self) -> bool:
        """Whether the next heartbeat runs the activation solve (under the lock, at most
        every `activation_period_s`): a server that answers heartbeats on its event loop
        runs that one on a thread instead (http/fast_routes.py)."""
        return self.fleet.replan_due(self.clock())

    def heartbeat_interval(self, worker_id: str | None = None, now: float | None = None):
        """The next heartbeat interval for the live fleet (heartbeat_pacing.py)."""
        return self.pacing.interval(self.clock() if now is None else now, worker_id)

    def leave(self, worker_id: str) -> None:
        with self._op():
            self.workers.leave(worker_id)
            self.timing.forget(worker_id)
            self.fleet.forget(worker_id)
            self.liveness.forget(worker_id)
            self.broadcast.leave(worker_id)
            self._replan()

    # -- leases --------------------------------------------------------------------------
    def admission_capacity(self, version: int | None = None) -> int:
        """How many groups may be leased + buffered now and still be fresh when consumed, for
        a lease generated at `version` (default and at most: the newest published)."""
        with self.lock:
            newest = self.versions.current().version
            return self.leasing.capacity(newest if version is None else version, newest)

    def lease(self, worker_id: str, req: LeaseRequest) -> LeaseResponse:
        r = self._lease(worker_id, req)
        if isinstance(r, LeaseResponse):  # a refusal, or an evaluation lease
            return r
        grant, reply = r
        self.db.sync()  # a grant is on disk before its reply; a refusal promises nothing
        return LeaseResponse(lease=self.leasing.content(grant), **reply)  # off the lock

    def _lease(self, worker_id: str, req: LeaseRequest) -> LeaseResponse | tuple[Grant, dict]:
        with self._op(durable=False):
            c, now = self.config, self.clock()
            self.db.expire_leases(now)
            self.learner.drop_stale(self.db.get("next_step", 0))
            self.workers.touch(worker_id, req.worker_version)
            ann = self.versions.current()
            self.liveness.claimed(
                worker_id, req.worker_version, req.unloadable_version, ann.version
            )
            reply = dict(
                announcement=ann,
                swap_to=self.versions.swap_to(req.worker_version),
                **self.broadcast.route(worker_id, ann.version),
            )
            if self.run_end.tell(worker_id):
                return LeaseResponse(reason="run_over", retry_after_s=c.retry_after_s, **reply)
            if ann.version < 0:
                return LeaseResponse(reason="no_version", retry_after_s=c.retry_after_s, **reply)
            if not self.workers.is_active(worker_id):
                return LeaseResponse(
                    reason="inactive", retry_after_s=c.heartbeat_interval_s, **reply
                )
            profile = self.workers.profile(worker_id)
            lease, reason, retry = self.leasing.offer(worker_id, req, ann.version, profile)
            if lease is None and eval_idle(reason, self.leasing.room(ann.version, ann.version)):
                # eval_leases.py: idle capacity only; the live fleet only if evals need it
                live = None if self.evals.idle() else self.workers.live_versions(now)
                ev, more = self.evals.offer(worker_id, req.worker_version, now, req.max_groups,
                                            newest=ann.version, live=live)  # fmt: skip
                if ev is not None:  # exactly the worker's version
                    return LeaseResponse(lease=ev, eval_pending=more, **reply)
            self.evals.unhold(worker_id)  # rollout work or none: it swaps as usual
            if lease is None:
                return LeaseResponse(reason=reason, retry_after_s=retry, **reply)
            return lease, reply

    def release(self, worker_id: str, lease_id: str, reason: str = "") -> bool:
        """Give a lease back (e.g. its reward failed); its unsubmitted groups requeue now."""
        if reason:  # the worker's own words: the operator's first clue to a broken task
            logging.warning("worker %s released lease %s: %s", worker_id, lease_id, reason)
        if self.evals.owns(lease_id):
            return self.evals.release(worker_id, lease_id)
        with self._op():
            if own_lease(self.db, worker_id, lease_id)["state"] != "active":
                return False
            self.db.end_lease(lease_id, "released")
            return True

    # -- submissions ---------------------------------------------------------------------
    def check_submission_lease(self, worker_id: str, lease_id: str) -> None:
        """The SubmissionError `submit` starts with for a lease `worker_id` does not hold
        (unknown: 404; another worker's: 403), from committed rows without the lock. The
        service asks before it builds a large parsed submission's Python objects: a body
        for a lease that is not the worker's costs the server no per-token work."""
        if not self.evals.owns(lease_id):  # evaluation leases: checked by `submit`
            own_lease(self.db.read_view(), worker_id, lease_id)

    def submit(self, worker_id: str, sub: Submission) -> SubmitResponse:
        """Check everything, score the completions outside the lock (rewards.py), then
        accept atomically; resubmissions are no-ops. An accepted completion holding a token
        the reward cannot see (scored 0, rewards.py `ScoringText`) counts against its
        worker (`WorkerRegistry.count_hidden`)."""
        resp = self._submit(worker_id, sub)
        if self.scorer is not None and resp.accepted:
            accepted = set(resp.accepted)
            trajs = [t for g in sub.groups if g.group_id in accepted for t in g.trajectories]
            if n := self.scorer.decoder.count_hidden(trajs):
                with self._op(durable=False):  # a counter: nothing a worker was promised
                    self.workers.count_hidden(worker_id, n)
        return resp

    def _submit(self, worker_id: str, sub: Submission) -> SubmitResponse:
        if self.evals.owns(sub.lease_id):  # evaluation: scored, recorded, never trained on
            with self._op():
                self.workers.touch(worker_id)
                ann = self.versions.current()
            out = self.evals.submit(worker_id, sub, ann.version, self.scorer)
            return SubmitResponse(
                announcement=ann, **out, **self.broadcast.route(worker_id, ann.version)
            )
        # The checks read committed rows without the lock (intake.py): one lock a submission.
        newest = self.versions.current().version
        fresh, prompts, drawn = self.intake.check(worker_id, sub, newest, self.db.read_view())
        self.workers.touch(worker_id)  # in memory: after the checks (bad input: no trace)
        scored = [
            (g.group_id, *self.scorer.score_group(
                g.group_id, prompts[g.group_id], g.trajectories, drawn.get(g.group_id)))
            for g in fresh
        ]  # fmt: skip
        with self._op():
            accepted, dups, done = self.intake.accept(worker_id, sub, scored)
            if done is not None:
                now = self.clock()
                self.timing.lease_done(worker_id, done.issued_at, now, done.late)
                self.fleet.lease_done(worker_id, done.issued_at, now, done.rollouts)
            self.learner.work_arrived(lambda: self.db.count("buffered"))  # wakes wait_batch
            ann = self.versions.current()
            return SubmitResponse(
                accepted=accepted,
                duplicates=dups,
                announcement=ann,
                swap_to=self.versions.swap_to(self.workers.version(worker_id)),
                **self.broadcast.route(worker_id, ann.version),
            )

    def episode_step(self, worker_id: str, req: EpisodeStep) -> EpisodeStepResponse:
        """The next observation of each episode of `worker_id`'s lease that `req` names, one
        model turn further (episode_steps.py; replays run in the reward pool)."""
        return self.episodes.observe(worker_id, req)

    # -- the learner's calls (learner_api.py) -------------------------------------------
    def take_batch(self, step: int, num_groups: int) -> tuple[list[ConsumedGroup] | None, dict]:
        """`num_groups` fresh groups for `step`, oldest version first; None if too few yet.
        The stats are the fleet metrics, plus the batch's staleness when there is one (none
        on a miss inside `wait_batch`). Only taking the rows holds the lock: the fsync, the
        decoding and the stats come after it."""
        with self._op(durable=False):
            rows = self.learner.take_rows(step, num_groups)
        if rows is None:
            return None, ({} if self.learner.polling() else self._stats())
        self.db.sync()  # the consumption on disk before the learner trains on it
        batch, staleness = build_batch(rows, step, self.content.seeds)
        return batch, {**self._stats(), **staleness}

    def wait_batch(
        self, step: int, num_groups: int, timeout_s: float
    ) -> tuple[list[ConsumedGroup] | None, dict]:
        """Block until `take_batch` succeeds or `timeout_s` passes (wall clock). The fleet
        stats are computed once, on return (not on every submission's wake-up), and the
        consumption is on disk before the batch is. The stats carry `time/data_wait_s`, the
        seconds this call waited for work to arrive (learner_api.py `wait_for_batch`)."""
        batch, stats = self.learner.wait_for_batch(
            lambda: self.take_batch(step, num_groups), timeout_s, self._stats, num_groups
        )
        if self.auto_staleness is not None:
            # The learner polls with short timeouts: its wait for a step is every call's.
            if self._step_wait[0] != step:
                self._step_wait = (step, 0.0)
            self._step_wait = (step, self._step_wait[1] + stats["time/data_wait_s"])
            if batch is not None:
                taken_at = self.config.staleness
                stats["staleness/bound"] = self._adapt_staleness(stats, self._step_wait[1])
                self._last_batch = (float(stats.get("staleness/mean", 0.0)), taken_at)
        return batch, stats

    def _adapt_staleness(self, stats: dict, step_wait_s: float) -> int:
        """`staleness="auto"`: one batch's evidence moves S (leasing/auto_staleness.py)."""
        confident = stats.get("capacity/confident", 0)
        trips = self.auto_staleness.kl_trips
        s = self.auto_staleness.observe(
            dropped_total=int(stats.get("staleness/dropped", 0)),
            data_wait_s=step_wait_s,
            step_s=float(stats.get("capacity/train_step_s") or 0.0),
            model_staleness=stats.get("capacity/min_staleness") if confident else None,
            estimate=None if confident else stats.get("capacity/min_staleness"),
            kl=self._kl,
        )
        if self.auto_staleness.kl_trips > trips:
            logging.warning(
                "staleness/kl %.3g at S = %d is past staleness_kl_max %.3g: S -> %d, and no "
                "higher than %d until the KL shows room",
                self._kl.kl, self._kl.staleness, self.config.staleness_kl_max, s,
                self.auto_staleness.kl_ceiling - 1,
            )  # fmt: skip
        self._kl = None  # each report is evidence once
        self.set_staleness(s)
        return s

    def report_learner(
        self,
        step_s: float | None = None,
        publish_s: float | None = None,
        overhead_s: float | None = None,
        cold: bool = False,
        staleness_kl: float | None = None,
    ) -> None:
        """The learner's train time of its last update (T for the capacity model; until it
        reports, the measured step period, waits included), on publishing steps the time to
        publish (0 or None: none this step), and its time outside train steps and waits
        since the previous update (evaluation, checkpoints, publishing). `cold`: XLA
        compiled since the previous report, a one-off: these times are left out while warm
        ones exist. `staleness_kl`: the update's `staleness/kl` on the batch it took last
        (auto S's KL ceiling). Call after each RL step."""
        with self.lock:
            self.fleet.learner_reported(step_s, publish_s, overhead_s, cold)
            self.liveness.stepped(self.clock())
            if staleness_kl is not None and self._last_batch is not None:
                self._kl = KlReport(float(staleness_kl), *self._last_batch)

    def export_cursor(self) -> dict:
        return self.learner.export_cursor()

    def restore_cursor(self, cursor: dict, version: int | None = None) -> int:
        """Put the groups consumed after a checkpoint back in the buffer; with `version`
        (the checkpoint's), also undo what a crashed run did past it (state/rollback.py)."""
        back = self.learner.restore_cursor(cursor)
        if version is not None:
            with self._op():
                self._persist_hot()  # the rows first, then undo on them, then read back
                rollback.roll_back(self.db, version)
                self.workers.reload()
                self.versions.reload()
        self.db.sync()
        return back

    def forget_consumed(self, up_to_step: int) -> int:
        return self.learner.forget_consumed(up_to_step)

    # -- the learner's side of the eval leases (evaluation/eval_leases.py) -----------------
    def configure_eval(self, workdir: str) -> None:
        """Write evaluation summaries to <workdir>/eval.jsonl, per-prompt lines beside it."""
        self.evals.configure(workdir)

    def request_eval(
        self,
        version: int,
        prompts: list[Prompt],
        n: int,
        temperature: float,
        step: int | None = None,
        eval_file: str = "",
    ) -> int:
        """Queue an evaluation of `version` on the fleet (`EvalBoard.request`); returns the
        number of eval groups."""
        return self.evals.request(version, prompts, n, temperature, step=step, eval_file=eval_file)

    def take_eval_results(self) -> list[dict]:
        """The summaries of the evaluations finished since the last call."""
        return self.evals.take_results()

    def take_eval_audit_rows(self) -> list[tuple]:
        """The sampled eval trajectories of finished versions, once each, for the audit."""
        return self.evals.take_audit_rows()

    def take_eval_check_rows(self) -> list[dict]:
        """Scored eval groups waiting for the learner's exact check, each with its worker's
        engine dtype (the check's margin follows it)."""
        rows = self.evals.take_check_rows()
        dtypes = {r["worker"]: self.learner.engine_dtype(r["worker"]) for r in rows}
        return [{**r, "engine_dtype": dtypes[r["worker"]]} for r in rows]

    def eval_verified(self, accepted: list[int], refused: list[int]) -> None:
        """The learner's exact-check verdict on eval groups (`EvalBoard.verified`)."""
        self.evals.verified(accepted, refused)

    def pending_eval_versions(self) -> list[int]:
        """Versions whose evaluation is queued or running."""
        return self.evals.pending_versions()

    # -- behaviour log-prob audit (bridge/control/trust/audit.py) ------------------------
    def audit(self, stats: Sequence[audit_lib.AuditStat]) -> list[str]:
        """Fold in the learner's per-worker comparison of behaviour and learner log-probs
        (`audit.rows_to_worker_stats`, after each step); returns the workers quarantined now:
        token revoked, leases ended, buffered groups requeued."""
        with self._op():
            out = self.auditor.fold(stats, self.clock())
            out += self._with_credential(out)
            for worker_id in out:
                self.workers.drop(worker_id)  # its token is gone
                self.timing.forget(worker_id)
                self.fleet.forget(worker_id)
                self.liveness.forget(worker_id)
            if out:
                self._replan()
            return out

    def _with_credential(self, quarantined: list[str]) -> list[str]:
        """The other worker ids of a quarantined worker's credential, quarantined with it
        (in the caller's transaction): the credential is one party whose count reached the
        rule, so its live id (registered before the ban) and its earlier ids' buffered
        groups go too. A host identity does not cascade: other workers behind one address
        may be other parties (identity.py)."""
        book = IdentityBook(self.db)
        creds = sorted({c for c in map(book.of, quarantined) if c and c.startswith("cred:")})
        out, now = [], self.clock()
        for cred in creds:
            done = set(self.db.quarantined())
            for w in book.workers_of(cred):
                if w not in done and self.db.worker(w) is not None:
                    audit_lib.quarantine(self.db, w, f"a worker of {cred} was quarantined", now)
                    out.append(w)
        return out

    # -- run end -------------------------------------------------------------------------
    def end_run(self, reason: str = "finished") -> None:
        """Training is over: from now on every worker that polls is told to leave."""
        with self._op():
            self.run_end.end(reason)

    def workers_told_run_over(self) -> bool:
        """True once every live worker was answered run_over since `end_run` (run_end.py)."""
        with self._op(durable=False):
            self._persist_hot()
            return self.run_end.all_told()

    def wait_run_over_seen(self, timeout_s: float) -> bool:
        """Poll `workers_told_run_over` until true or `timeout_s` passes (wall clock): the
        drain between `end_run()` and stopping the server."""
        return run_end_wait(self.workers_told_run_over, timeout_s)

    def status(self, only: str | None = None) -> dict:
        """The fleet table and the run's step, staleness and spend (fleet_status.py);
        `only`: that worker's row alone (what a worker may see)."""
        stats = self._stats()  # writes the hot state first
        with self._op():
            self.db.expire_leases(self.clock())
            return fleet_status.fleet_status(
                self.db,
                self.config,
                self.clock(),
                stats,
                policy_version=self.versions.current().version,
                too_slow=self.timing.too_slow,
                active=self.workers.is_active,
                identities=self.workers.identities.table(),
                only=only,
            )

    # -- metrics -------------------------------------------------------------------------
    def stats(self) -> dict:
        return self._stats()

    def _stats(self) -> dict:
        """The metrics line (call without the lock). Under the lock only the hot state is
        written and the fleet's measurements copied; the reads of every worker's rows and
        the capacity model run after it, on that copy and a read view of the committed
        rows: at 2000 workers they held the lock ~70 ms per learner step while leases
        queued behind them."""
        with self._op(durable=False):
            self.db.expire_leases(self.clock())
            self._persist_hot()
            version, capacity = self.versions.current().version, self.admission_capacity()
            now, next_step = self.clock(), self.db.get("next_step", 0)
            live = self.workers.live_versions(now)
        with self.lock:  # the copy and the rows of one moment: the transaction committed
            fleet = self.fleet.frozen(self.db.pinned_view())
        try:
            out = stats_line(now, fleet.db, fleet, version, capacity, self.limits, self.broadcast)
        finally:
            self.db.unpin(fleet.db)
        self.fleet.confident = fleet.confident
        held = out["groups/leased"] + out["groups/buffered"]
        with self.lock:
            stuck = self.liveness.no_admissible_work(now, version, next_step, live, held)
        out["fleet/no_admissible_work"] = int(stuck)
        out["learner/since_last_step_s"] = self.liveness.since_last_step_s(now)
        return out


def _local_manifest_sha256(store, version: int) -> str | None:
    """SHA-256 of `version`'s manifest in `store` when that is a file store (a read that
    cannot hang); None otherwise (a remote store's hash is the publisher's to pass), or
    when it cannot be read: workers then take the manifest from the store only."""
    from bridge.broadcast.chunks import manifest_sha256
    from bridge.store.layout import LAYOUT
    from bridge.store.weight_store import WeightStore, parse_spec

    try:
        if store is None or parse_spec(store)["driver"] != "file":
            return None
        r = WeightStore(store).kv.read(LAYOUT.manifest_key(version)).result(timeout=10)
    except Exception as e:  # noqa: BLE001 - a bad spec, a missing directory
        logging.warning("version %d: manifest not readable for its hash: %s", version, e)
        return None
    return manifest_sha256(r.value) if r.state == "value" else None
