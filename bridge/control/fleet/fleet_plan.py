"""The live fleet plan: the capacity model on measured inputs, and cost-aware activation.

`FleetPlan` is a part of `Controller` (bridge/control/controller.py), which feeds it what it
observes and adds `stats()` to every batch's metrics. Formulas: bridge/control/fleet/capacity.py
(requirement, min staleness, predicted utilization) and bridge/control/fleet/activation.py (the
cheapest covering set, with hysteresis).

Inputs, all measured on the controller's clock; nothing here takes a worker's word (the
heartbeats' self-reported samples_per_s are not used: a worker claiming to be fast would be
activated and billed, and its own meter counts idle time as slowness):
- T, the learner's train time per update, from `Controller.report_learner(step_s=...)`
  (median of the warm reports, capacity.Warmup: the first includes the XLA compile). Until
  the learner reports, the step period lease_timing measures, which includes the learner's
  waits and so understates the requirement while the fleet is short.
- O, the learner's mean time per update outside train steps and waits (publishing,
  evaluation, checkpoints), from `report_learner(overhead_s=...)`. The learner consumes one
  batch per T + O, so the requirement and the freshness bound use that cycle, and the
  predicted utilization (train time only, like `learner/utilization`) is the cycle's busy
  fraction times T / (T + O) (without O it ran ~10 points high on the demo).
- R = groups_per_step * group_size rollouts per update; S = `staleness`.
- kappa = the difference between consecutive published versions (version = update count).
- T_pub from `report_learner(publish_s=...)` on publishing steps (0 or None: none this step).
- Per worker, over its last `_LEASES_KEPT` completed leases (issue -> last submission):
  mu_i = rollouts / the time it held at least one of them (the union of the intervals), so
  time spent waiting for admission is not slowness and concurrent leases count once;
  T_gen,i = their mean duration; swap_i = publish of a version -> the first contact where
  the worker reports it (an overestimate by up to one heartbeat interval), the median of
  its warm swaps. Cold (capacity.Warmup) and left out of the capacity model while warm ones
  exist: a worker's first lease (vLLM's kernel compile), any lease during which it swapped,
  its first two swaps (engine start, first reload). Activation and the status table keep
  the rate over every lease (a worker is measured, and can be put on standby, from its
  first lease on).
- latency = T_pub + max over active workers not refused as too slow of (swap_i + T_gen,i):
  the last rollout of a version comes from the slowest worker that still gets work. The
  active throughput sums the same workers: a refused one makes nothing usable.

Capacity metrics appear once T is known. `capacity/confident` is 1 once T and every counted
worker's leases and swaps have `Warmup.min_warm` warm samples, every active one measured.
`capacity/warning` is 1 when the prediction is confident and the rate or the freshness
condition fails; the console's words on it: bridge/control/fleet/capacity_advice.py.

Activation (`activation=True`): the active set is re-solved on join, leave and quarantine
and at most every `activation_period_s` on heartbeats (measured speeds and T change
continuously; `decide`'s hysteresis keeps jitter from flipping the set). Unmeasured workers
stay active: they must lease to be measured. A worker's speed counts only once the audit
vouches for its own work (audit.vouches); until then it is unmeasured, so it can neither
be put on standby nor put anyone else there. Before T is known nothing changes. Standby
workers are told `active=false` and get no leases; they are billed `standby_price_fraction`
of their price while alive (0: released, not billed).

Persistence (SQLite `fleet` table via ControllerDB): each worker's standby flag, when it last
changed, its standby seconds and its measured mu, so after a controller restart the set and
the bill stand and activation resumes on the measured speeds. T, kappa, T_pub and latencies
are re-measured.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import json
import logging
import math
import threading

from bridge.control.fleet import activation, capacity, capacity_advice
from bridge.control.trust import audit

_EMA = 0.3  # weight of the newest sample in the moving averages
_LEASES_KEPT = 16  # per worker: enough to smooth one slow lease, recent enough to track change
_VERSIONS_KEPT = 64  # publish times remembered for the swap latency
_OVERHEADS_KEPT = 64  # learner overheads averaged: spans several evaluation periods


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - _EMA) * old + _EMA * new


def _price(w) -> float:
    return _profile_price(w["profile"])


@functools.lru_cache(maxsize=65536)  # one JSON parse per profile: stats runs every batch
def _profile_price(profile: str) -> float:
    return json.loads(profile)["price_per_hour"]


def _col(rows: dict, worker_id: str, key: str, default=None):
    """A column of `worker_id`'s fleet row (`default` if it has none yet)."""
    row = rows.get(worker_id)
    return default if row is None else row[key]


class FleetPlan:
    """Measurements, capacity metrics, the active set; under the controller's lock and tx."""

    def __init__(self, config, db, timing, clock, warmup: capacity.Warmup | None = None):
        self.config, self.db, self.timing, self.clock = config, db, timing, clock
        self.warmup = warmup = warmup or capacity.Warmup()
        self._steps = capacity.WarmSamples(warmup.cold_steps, warmup.keep)
        self._overheads = capacity.WarmSamples(warmup.cold_overheads, _OVERHEADS_KEPT)
        self.publish_s: float | None = None
        self.publish_every = 1
        self._last_version: int | None = None
        self._published: dict[int, float] = {}
        self._leases: dict[str, collections.deque] = {}  # every lease, the fallback
        self._warm_leases: dict[str, collections.deque] = {}
        self._done: dict[str, int] = {}  # completed leases per worker
        self._held: dict[str, collections.deque] = {}  # when the controller held it back
        self._swaps: dict[str, capacity.WarmSamples] = {}  # publish -> first seen on it
        self._swap_at: dict[str, list] = {}  # when its cold swaps (Warmup.cold_swaps) were seen
        self.confident = False
        self._solved_at = -math.inf
        # Hot (hot_state.py): each worker's standby flag and when it changed, read on every
        # heartbeat, and standby seconds billed since the last `persist`, in memory.
        self._hot = threading.Lock()
        self._standby_at = {
            w: (bool(r["standby"]), r["changed_at"]) for w, r in db.fleet_rows().items()
        }
        self._standby_s: dict[str, float] = {}
        self.advice = capacity_advice.Advice(config.staleness)
        self._stats_lock = threading.Lock()  # shared with the frozen copies

    # -- measurements --------------------------------------------------------------------
    @property
    def step_s(self) -> float | None:
        return self._steps.estimate()

    @property
    def overhead_s(self) -> float:
        """O: the learner's mean time per update outside train steps and waits (the mean,
        not the median: evaluations and checkpoints are rare long spikes that the learner
        pays on average; a compile is not: reports flagged cold are left out, and the
        first `Warmup.cold_overheads`, the run settling)."""
        return self._overheads.mean() or 0.0

    def learner_reported(self, step_s, publish_s, overhead_s=None, cold: bool = False) -> None:
        if step_s is not None and step_s > 0:
            self._steps.add(step_s, cold)
        if overhead_s is not None and overhead_s >= 0:
            self._overheads.add(overhead_s, cold)
        if publish_s is not None and publish_s > 0:
            self.publish_s = _ema(self.publish_s, publish_s)

    def published(self, version: int, now: float) -> None:
        if self._last_version is not None and version > self._last_version:
            self.publish_every = version - self._last_version
        if version != self._last_version:
            self._published[version] = now
            for v in sorted(self._published)[:-_VERSIONS_KEPT]:
                del self._published[v]
        self._last_version = version

    def swapped(self, worker_id: str, version: int, now: float) -> None:
        """`worker_id` reported `version` for the first time."""
        cold = self._swap_at.setdefault(worker_id, [])
        if len(cold) < self.warmup.cold_swaps:
            cold.append(now)
        at = self._published.get(version)
        if at is not None:
            w = self.warmup
            swaps = self._swaps.setdefault(worker_id, capacity.WarmSamples(w.cold_swaps, w.keep))
            swaps.add(max(0.0, now - at))

    def held_back(self, worker_id: str, now: float) -> None:
        """`worker_id` asked for work and the controller gave none for its own reasons."""
        self._held.setdefault(worker_id, collections.deque(maxlen=_LEASES_KEPT)).append(now)

    def lease_done(self, worker_id: str, issued_at: float, now: float, rollouts: int) -> None:
        done = self._done[worker_id] = self._done.get(worker_id, 0) + 1
        # Cold: the first leases (compile), or one during which the worker made a cold swap
        # (engine start, first reload). Warm swaps are the steady state: with a version every
        # step a worker swaps every few leases, and leaving those leases out overstated it.
        cold = done <= self.warmup.cold_leases or any(
            issued_at < t <= now for t in self._swap_at.get(worker_id, ())
        )
        lease = (issued_at, now, rollouts)
        for store, keep in ((self._leases, True), (self._warm_leases, not cold)):
            if keep:
                store.setdefault(worker_id, collections.deque(maxlen=_LEASES_KEPT)).append(lease)
        # Activation and the status table keep every lease's rate (a worker is measured from
        # its first lease on); the capacity model uses the warm ones (`_mu`).
        self.db.set_rollout_rate(worker_id, capacity.busy_rate(self._leases[worker_id])[0])

    def _lease_sample(self, worker_id: str):
        """The worker's warm leases, else (none warm yet) all of them."""
        return self._warm_leases.get(worker_id) or self._leases[worker_id]

    def _mu(self, rows: dict, worker_id: str) -> float | None:
        """mu_i from the warm leases, else the stored rate (None: unmeasured)."""
        if not (warm := self._warm_leases.get(worker_id)):
            return _col(rows, worker_id, "rollouts_per_s")
        return capacity.own_rate(warm, self._held.get(worker_id, ()))

    def _swap_s(self, worker_id: str) -> float:
        swaps = self._swaps.get(worker_id)
        return (swaps.estimate() if swaps is not None else None) or 0.0

    def _warm_enough(self, worker_id: str) -> bool:
        n = self.warmup.min_warm
        swaps = self._swaps.get(worker_id)
        return len(self._warm_leases.get(worker_id, ())) >= n and len(swaps or ()) >= n

    def forget(self, worker_id: str) -> None:
        parts = (self._leases, self._warm_leases, self._done, self._swaps, self._swap_at)
        for part in (*parts, self._held):
            part.pop(worker_id, None)

    def train_step_s(self) -> float | None:
        """T: the learner's report, else the measured period; None while unknown (or 0)."""
        t = self.step_s if self.step_s is not None else self.timing.step_period_s
        return t if t is not None and t > 0 else None

    # -- activation ----------------------------------------------------------------------
    def _standby(self) -> set[str]:
        if not self.config.activation:
            return set()
        return {wid for wid, r in self.db.fleet_rows().items() if r["standby"]}

    def is_active(self, worker_id: str) -> bool:
        standby = self._standby_at.get(worker_id, (False, 0.0))[0]  # in memory: heartbeats
        return not (self.config.activation and standby)

    def replan_due(self, now: float) -> bool:
        c = self.config
        due = now - self._solved_at >= c.activation_period_s
        return c.activation and due and self.train_step_s() is not None

    def _alive(self, now: float, workers: list | None = None) -> list:
        timeout = self.config.worker_timeout_s
        return [
            w
            for w in (self.db.workers() if workers is None else workers)
            if w["enabled"] and w["left_at"] is None and now - w["last_seen"] <= timeout
        ]

    def replan(self, now: float, force: bool = False) -> activation.Decision | None:
        """Re-solve the active set (forced, or at most every activation_period_s)."""
        c, step_s = self.config, self.train_step_s()
        if not c.activation or step_s is None:
            return None
        if not force and now - self._solved_at < c.activation_period_s:
            return None
        self._solved_at = now
        rows, standby = self.db.fleet_rows(), self._standby()
        vouched = lambda w: audit.vouches(self.db, w, c.audit_min_tokens)  # audited work only
        offers = [
            activation.Offer(
                w["worker_id"],
                _price(w),
                _col(rows, w["worker_id"], "rollouts_per_s") if vouched(w["worker_id"]) else None,
            )
            for w in self._alive(now)
        ]
        previous = [o.worker_id for o in offers if o.worker_id not in standby]
        required = capacity.required_rollouts_per_s(
            c.groups_per_step * c.group_size, step_s + self.overhead_s
        )
        d = activation.decide(offers, required, c.activation_margin, previous=previous)
        changed = [
            o.worker_id for o in offers if (o.worker_id in d.standby) != (o.worker_id in standby)
        ]
        for wid in changed:
            self.db.set_standby(wid, wid in d.standby, now)
            self._standby_at[wid] = (wid in d.standby, now)
        if changed:
            logging.info(
                "activation: %d active (%.2f rollouts/s, %.2f USD/h), %d on standby; the "
                "learner needs %.2f rollouts/s (+%.0f%% margin)%s",
                len(d.active),
                d.active_rollouts_per_s,
                d.price_per_hour,
                len(d.standby),
                required,
                100 * c.activation_margin,
                f"; the whole fleet is {d.shortfall_rollouts_per_s:.2f} short"
                if d.shortfall_rollouts_per_s > 0
                else "",
            )
        return d

    def accrue(self, worker_id: str, last_seen: float, now: float) -> None:
        """Bill the standby part of a contact gap [last_seen, now] (the controller bills the
        whole gap as alive time; standby time is then charged at the standby fraction)."""
        at = self._standby_at.get(worker_id)  # in memory: heartbeats bill (no SQLite)
        if not self.config.activation or at is None:
            return
        standby, changed_at = at
        if changed_at > last_seen:  # the state changed within the gap: split it
            seconds = now - changed_at if standby else changed_at - last_seen
        else:
            seconds = now - last_seen if standby else 0.0
        if seconds > 0:
            with self._hot:
                self._standby_s[worker_id] = self._standby_s.get(worker_id, 0.0) + seconds

    def persist(self) -> None:
        """Write the standby seconds billed since the last call."""
        with self._hot:
            billed, self._standby_s = self._standby_s, {}
        for worker_id, seconds in billed.items():
            self.db.add_standby_s(worker_id, seconds)

    # -- metrics -------------------------------------------------------------------------
    def frozen(self, db) -> FleetPlan:
        """A copy of the measurements for `stats` off the controller's lock (the caller
        holds it now; `db`: a read view of the committed rows, hot state persisted). The
        copies are C-level (~1 us a worker); the stats' O(fleet) reads and capacity model,
        ~70 ms at 2000 workers, then run on the copy while leases go on."""
        f = copy.copy(self)
        f.db, f.timing = db, copy.copy(self.timing)
        f.timing.too_slow = set(self.timing.too_slow)
        f._leases = {w: tuple(d) for w, d in self._leases.items()}
        f._warm_leases = {w: tuple(d) for w, d in self._warm_leases.items()}
        f._held = {w: tuple(d) for w, d in self._held.items()}
        f._swaps = {w: s.copy() for w, s in self._swaps.items()}
        f._steps, f._overheads = self._steps.copy(), self._overheads.copy()
        f._standby_at = dict(self._standby_at)
        return f

    def stats(self, now: float, accepted_rollouts: int) -> dict:
        """Fleet, cost and capacity metrics (capacity ones once T is known). On a `frozen`
        copy, off the lock: one at a time (the advice it gives is shared)."""
        with self._stats_lock:
            return self._stats(now, accepted_rollouts)

    def _stats(self, now: float, accepted_rollouts: int) -> dict:
        c, rows, standby = self.config, self.db.fleet_rows(), self._standby()
        workers = self.db.workers()
        alive = self._alive(now, workers)
        active = [w for w in alive if w["worker_id"] not in standby]
        off = 1.0 - c.standby_price_fraction
        # Alive time is billed in full, its standby part at the standby fraction.
        billed_s = [
            w["active_s"] - off * _col(rows, w["worker_id"], "standby_s", 0.0) for w in workers
        ]
        cost = sum(_price(w) * s for w, s in zip(workers, billed_s, strict=True)) / 3600.0
        out = {
            "fleet/active_workers": len(active),
            "fleet/standby_workers": len(alive) - len(active),
            "fleet/rollouts_per_s": sum(w["samples_per_s"] for w in active),
            "fleet/too_slow_workers": sum(w["worker_id"] in self.timing.too_slow for w in alive),
            "cost/usd": cost,
        }
        if accepted_rollouts > 0:
            out["cost/usd_per_1k_rollouts"] = 1000.0 * cost / accepted_rollouts
        return {**out, **self._capacity([w["worker_id"] for w in active], rows, now)}

    def _capacity(self, active: list[str], rows: dict, now: float) -> dict:
        c, step_s = self.config, self.train_step_s()
        if step_s is None:
            return {}
        mus = [self._mu(rows, w) for w in active]
        unmeasured = any(mu is None for mu in mus)
        counted = [
            (w, mu)
            for w, mu in zip(active, mus, strict=True)
            if w in self._leases and w not in self.timing.too_slow
        ]
        delays = [
            (self._swap_s(w) + capacity.busy_rate(self._lease_sample(w))[1], mu or 0.0)
            for w, mu in counted
        ]
        # A verdict only on warm inputs: T's, and every counted worker's leases and swaps.
        self.confident = (
            len(self._steps) >= self.warmup.min_warm
            and not unmeasured
            and bool(counted)
            and all(self._warm_enough(w) for w, _ in counted)
        )
        rollouts_per_step = c.groups_per_step * c.group_size
        # The learner's cycle is T + O (it consumes a batch per cycle); utilization counts
        # train time only, T / (T + O) of a fully fed cycle.
        train_s, step_s = step_s, step_s + self.overhead_s
        latency = (self.publish_s or 0.0) + _covering_delay(delays, rollouts_per_step / step_s)
        # A worker refused as too slow makes nothing the learner can use (lease_timing.py).
        usable = [
            mu or 0.0 for w, mu in zip(active, mus, strict=True) if w not in self.timing.too_slow
        ]
        # The first R rollouts of a version come from the fastest-returning workers first.
        first = (self.publish_s or 0.0) + capacity.arrival_s(delays, rollouts_per_step)
        rep = capacity.report(
            sum(usable),
            rollouts_per_step,
            step_s,
            c.staleness,
            self.publish_every,
            latency,
            first_rollouts_s=first if math.isfinite(first) else None,
        )
        share = train_s / step_s  # train time's share of the cycle T + O
        rep = dataclasses.replace(rep, predicted_utilization=rep.predicted_utilization * share)
        # An unmeasured active worker makes the fleet look short: no verdict on the rate yet.
        judged = dataclasses.replace(rep, rate_ok=rep.rate_ok or unmeasured)
        self.advice.say(judged, now, self.confident, train_s, latency, step_s - train_s)
        return {
            "capacity/required_rollouts_per_s": rep.required_rollouts_per_s,
            "capacity/active_rollouts_per_s": rep.active_rollouts_per_s,
            "capacity/predicted_utilization": rep.predicted_utilization,
            "capacity/min_staleness": rep.min_staleness,
            "capacity/train_step_s": train_s,
            "capacity/learner_overhead_s": step_s - train_s,
            "capacity/latency_s": latency,
            # Which bound sets the prediction (the rate's, or freshness via first_rollouts).
            "capacity/rate_bound": min(1.0, sum(usable) * step_s / rollouts_per_step) * share,
            "capacity/first_rollouts_s": first if math.isfinite(first) else -1.0,
            "capacity/confident": int(self.confident),
            "capacity/warning": int(self.confident and not (judged.rate_ok and judged.fresh_ok)),
        }


def _covering_delay(delays: list[tuple[float, float]], required: float) -> float:
    """The fleet's swap + generation delay that matters for freshness: the smallest delay D
    such that the workers no slower than D cover the requirement. A slow worker's late
    rollouts only cost its own throughput (the rate check sees that); judging freshness by
    the slowest worker warned about a demo fleet that kept the learner 99% busy."""
    covered = 0.0
    for delay, mu in sorted(delays):
        covered += mu
        if covered >= required:
            return delay
    return max((d for d, _ in delays), default=0.0)
