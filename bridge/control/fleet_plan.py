"""The live fleet plan: the capacity model on measured inputs, and cost-aware activation.

`FleetPlan` is a part of `Controller` (bridge/control/controller.py), which feeds it what it
observes and adds `stats()` to every batch's metrics. Formulas: bridge/control/capacity.py
(requirement, min staleness, predicted utilization) and bridge/control/activation.py (the
cheapest covering set, with hysteresis).

Inputs, all measured on the controller's clock; nothing here takes a worker's word (the
heartbeats' self-reported samples_per_s are not used: a worker claiming to be fast would be
activated and billed, and its own meter counts idle time as slowness):
- T, the learner's train time per update, from `Controller.report_learner(step_s=...)`
  (moving average). Until the learner reports, the step period lease_timing measures, which
  includes the learner's waits and so understates the requirement while the fleet is short.
- R = groups_per_step * group_size rollouts per update; S = `staleness`.
- kappa = the difference between consecutive published versions (version = update count).
- T_pub from `report_learner(publish_s=...)` on publishing steps (0 or None: none this step).
- Per worker, over its last `_LEASES_KEPT` completed leases (issue -> last submission):
  mu_i = rollouts / the time it held at least one of them (the union of the intervals), so
  time spent waiting for admission is not slowness and concurrent leases count once;
  T_gen,i = their mean duration; swap_i = publish of a version -> the first contact where
  the worker reports it (an overestimate by up to one heartbeat interval).
- latency = T_pub + max over active workers not refused as too slow of (swap_i + T_gen,i):
  the last rollout of a version comes from the slowest worker that still gets work.

Capacity metrics appear once T is known. `capacity/warning` is 1 when the rate or the
freshness condition fails; the rate is judged only once every active worker is measured
(an unmeasured one would look like missing capacity). The log names the fix
(`CapacityReport.advice`) when the verdict gets worse (a new cause, or a larger S needed),
at most once a minute, and repeats an unchanged verdict every 10 minutes: a per-minute
repeat of the same advice filled the demo's console without saying anything new.

Activation (`activation=True`): the active set is re-solved on join, leave and quarantine
and at most every `activation_period_s` on heartbeats (measured speeds and T change
continuously; `decide`'s hysteresis keeps jitter from flipping the set). Unmeasured workers
stay active: they must lease to be measured. Before T is known nothing changes. Standby
workers are told `active=false` and get no leases; they are billed `standby_price_fraction`
of their price while alive (0: released, not billed).

Persistence (SQLite `fleet` table via ControllerDB): each worker's standby flag, when it last
changed, its standby seconds and its measured mu, so after a controller restart the set and
the bill stand and activation resumes on the measured speeds. T, kappa, T_pub and latencies
are re-measured.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math

from bridge.control import activation, capacity

_EMA = 0.3  # weight of the newest sample in the moving averages
_LEASES_KEPT = 16  # per worker: enough to smooth one slow lease, recent enough to track change
_WARN_EVERY_S = 60.0  # at most one capacity warning a minute
_WARN_REPEAT_S = 600.0  # the same verdict again after this long
_VERSIONS_KEPT = 64  # publish times remembered for the swap latency


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - _EMA) * old + _EMA * new


def busy_rate(leases) -> tuple[float, float]:
    """(rollouts per busy second, mean lease duration) of (issued, done, rollouts) leases."""
    busy, end = 0.0, -math.inf
    for t0, t1, _ in sorted(leases):
        busy += max(0.0, t1 - max(t0, end))
        end = max(end, t1)
    rollouts = sum(n for _, _, n in leases)
    return rollouts / max(busy, 1e-9), sum(t1 - t0 for t0, t1, _ in leases) / len(leases)


def _price(w) -> float:
    return json.loads(w["profile"])["price_per_hour"]


def _col(rows: dict, worker_id: str, key: str, default=None):
    """A column of `worker_id`'s fleet row (`default` if it has none yet)."""
    row = rows.get(worker_id)
    return default if row is None else row[key]


class FleetPlan:
    """Measurements, capacity metrics and the active set; called under the controller's lock
    inside its transaction."""

    def __init__(self, config, db, timing, clock):
        self.config, self.db, self.timing, self.clock = config, db, timing, clock
        self.step_s: float | None = None
        self.publish_s: float | None = None
        self.publish_every = 1
        self._last_version: int | None = None
        self._published: dict[int, float] = {}
        self._leases: dict[str, collections.deque] = {}
        self._swap_s: dict[str, float] = {}
        self._solved_at = -math.inf
        self._warned_at = -math.inf
        self._warned_causes: frozenset[str] = frozenset()
        self._warned_staleness = 0  # the largest min_staleness a warning named

    # -- measurements --------------------------------------------------------------------
    def learner_reported(self, step_s: float | None, publish_s: float | None) -> None:
        if step_s is not None and step_s > 0:
            self.step_s = _ema(self.step_s, step_s)
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
        at = self._published.get(version)
        if at is not None:
            self._swap_s[worker_id] = _ema(self._swap_s.get(worker_id), max(0.0, now - at))

    def lease_done(self, worker_id: str, issued_at: float, now: float, rollouts: int) -> None:
        leases = self._leases.setdefault(worker_id, collections.deque(maxlen=_LEASES_KEPT))
        leases.append((issued_at, now, rollouts))
        self.db.set_rollout_rate(worker_id, busy_rate(leases)[0])

    def forget(self, worker_id: str) -> None:
        self._leases.pop(worker_id, None)
        self._swap_s.pop(worker_id, None)

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
        row = self.db.fleet_row(worker_id)  # one row: this runs on every lease and heartbeat
        return not (self.config.activation and row is not None and row["standby"])

    def _alive(self, now: float) -> list:
        timeout = self.config.worker_timeout_s
        return [
            w
            for w in self.db.workers()
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
        offers = [
            activation.Offer(
                w["worker_id"], _price(w), _col(rows, w["worker_id"], "rollouts_per_s")
            )
            for w in self._alive(now)
        ]
        previous = [o.worker_id for o in offers if o.worker_id not in standby]
        required = capacity.required_rollouts_per_s(c.groups_per_step * c.group_size, step_s)
        d = activation.decide(offers, required, c.activation_margin, previous=previous)
        changed = [
            o.worker_id for o in offers if (o.worker_id in d.standby) != (o.worker_id in standby)
        ]
        for wid in changed:
            self.db.set_standby(wid, wid in d.standby, now)
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
        row = self.db.fleet_row(worker_id)
        if not self.config.activation or row is None:
            return
        if row["changed_at"] > last_seen:  # the state changed within the gap: split it
            seconds = now - row["changed_at"] if row["standby"] else row["changed_at"] - last_seen
        else:
            seconds = now - last_seen if row["standby"] else 0.0
        if seconds > 0:
            self.db.add_standby_s(worker_id, seconds)

    # -- metrics -------------------------------------------------------------------------
    def stats(self, now: float, accepted_rollouts: int) -> dict:
        """Fleet, cost and capacity metrics (capacity ones once T is known)."""
        c, rows, standby = self.config, self.db.fleet_rows(), self._standby()
        workers = self.db.workers()
        alive = self._alive(now)
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
        mus = [_col(rows, w, "rollouts_per_s") for w in active]
        unmeasured = any(mu is None for mu in mus)
        delays = [
            (self._swap_s.get(w, 0.0) + busy_rate(self._leases[w])[1], mu or 0.0)
            for w, mu in zip(active, mus, strict=True)
            if w in self._leases and w not in self.timing.too_slow
        ]
        rollouts_per_step = c.groups_per_step * c.group_size
        latency = (self.publish_s or 0.0) + _covering_delay(delays, rollouts_per_step / step_s)
        rep = capacity.report(
            sum(mu or 0.0 for mu in mus),
            rollouts_per_step,
            step_s,
            c.staleness,
            self.publish_every,
            latency,
        )
        # An unmeasured active worker makes the fleet look short: no verdict on the rate yet.
        judged = dataclasses.replace(rep, rate_ok=rep.rate_ok or unmeasured)
        self._warn(judged, now)
        return {
            "capacity/required_rollouts_per_s": rep.required_rollouts_per_s,
            "capacity/active_rollouts_per_s": rep.active_rollouts_per_s,
            "capacity/predicted_utilization": rep.predicted_utilization,
            "capacity/min_staleness": rep.min_staleness,
            "capacity/train_step_s": step_s,
            "capacity/latency_s": latency,
            "capacity/warning": int(not (judged.rate_ok and judged.fresh_ok)),
        }

    def _warn(self, rep: capacity.CapacityReport, now: float) -> None:
        checks = (("rate", rep.rate_ok), ("fresh", rep.fresh_ok))
        causes = frozenset(k for k, ok in checks if not ok)
        if not causes:
            return
        worse = bool(causes - self._warned_causes) or (
            "fresh" in causes and rep.min_staleness > self._warned_staleness
        )
        since = now - self._warned_at
        if since < _WARN_EVERY_S or (not worse and since < _WARN_REPEAT_S):
            return
        self._warned_at, self._warned_causes = now, self._warned_causes | causes
        if "fresh" in causes:
            self._warned_staleness = max(self._warned_staleness, rep.min_staleness)
        logging.warning(
            "capacity: the learner will wait (predicted utilization %.0f%%): %s",
            100 * rep.predicted_utilization,
            rep.advice(self.config.staleness),
        )


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
