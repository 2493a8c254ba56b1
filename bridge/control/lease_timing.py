"""Freshness-aware leasing: give a worker only work it can return before it goes stale.

This is the paper's freshness condition (PAPER.md, capacity model) applied per worker and
measured live. A group leased now to a worker at version v may be consumed up to step
v + S. The learner takes one batch per step period T; the batch for step v + S is taken
about (v + S - t + 1) * T after the previous batch, t being the learner's next step. So a
lease issued now must come back within

    window = (v + S - t + 1) * T - (now - last_batch)

T is measured by the controller (moving average of the time between batches; while the
learner waits for data the current wait counts too, so T grows when the fleet is short and
a slow worker becomes useful again). Each worker's lease latency (issue -> last
submission: the paper's T_gen plus the worker's swap-free overheads) is measured by the
controller too, never taken from the worker's word. A worker is refused (reason
"too_slow") on evidence only: its last lease came back already stale, and its latency
exceeds the window now, so the next one would be wasted as well. (Timing alone would also
refuse a fast worker whose one lease was slow on a loaded machine, although its work was
used.)

A latency estimate older than `retest_after_s` is forgotten, so a refused worker gets one
lease now and then and is measured again (it may have become faster, or the learner
slower). Before the first measurements (of T or of the worker) nothing is refused.
In memory only: after a controller restart everything is measured again.
"""

from __future__ import annotations

import dataclasses
import logging
import math

_EMA = 0.3  # weight of the newest sample in the moving averages


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - _EMA) * old + _EMA * new


@dataclasses.dataclass
class _Latency:
    seconds: float
    measured_at: float
    late: bool  # the last lease came back already too stale to be used


class LeaseTiming:
    def __init__(self, staleness: int, retest_after_s: float, refuse: bool = True):
        self.staleness, self.retest_after_s, self.refuse = staleness, retest_after_s, refuse
        self._warned: dict[str, float] = {}  # worker -> when it was last reported slow
        self.step_period_s: float | None = None
        self.last_batch_at: float | None = None
        self.latency: dict[str, _Latency] = {}
        self.too_slow: set[str] = set()  # workers refused at their last lease request

    def batch_taken(self, now: float) -> None:
        if self.last_batch_at is not None:
            self.step_period_s = _ema(self.step_period_s, now - self.last_batch_at)
        self.last_batch_at = now

    def lease_done(self, worker_id: str, issued_at: float, now: float, late: bool) -> None:
        old = self.latency.get(worker_id)
        seconds = _ema(old.seconds if old else None, max(0.0, now - issued_at))
        self.latency[worker_id] = _Latency(seconds, now, late)

    def window_s(self, worker_version: int, next_step: int, now: float) -> float | None:
        """Seconds a lease issued now may take; None while the step period is unknown."""
        if self.step_period_s is None:
            return None
        since = now - self.last_batch_at
        period = max(self.step_period_s, since)
        return (worker_version + self.staleness - next_step + 1) * period - since

    def fresh_enough(self, worker_id: str, worker_version: int, next_step: int, now: float):
        """(ok, latency, window): False only on a recent late lease and a too-long latency."""
        lat, window = self.latency.get(worker_id), self.window_s(worker_version, next_step, now)
        if lat is not None and now - lat.measured_at > self.retest_after_s:
            del self.latency[worker_id]  # too old: lease once more to measure again
            lat = None
        ok = lat is None or window is None or not lat.late or lat.seconds <= window
        (self.too_slow.discard if ok else self.too_slow.add)(worker_id)
        return ok, (lat.seconds if lat else None), window

    def admit(self, worker_id: str, worker_version: int, next_step: int, now: float) -> bool:
        """`fresh_enough`, warning about a too-slow worker; always True if not `refuse`."""
        ok, latency, window = self.fresh_enough(worker_id, worker_version, next_step, now)
        # A borderline worker flips between fits and does not fit within a step: say it once
        # per re-measuring period, not at every flip.
        if not ok and now - self._warned.get(worker_id, -math.inf) > self.retest_after_s:
            self._warned[worker_id] = now
            logging.warning(
                "worker %s %s: its leases take %.2fs but must be back within %.2fs "
                "(staleness %d at the learner's current pace). It is still billed; raise "
                "staleness or stop it (re-measured every %.0fs).",
                worker_id,
                "gets no work for now" if self.refuse else "returns work too late",
                latency,
                window,
                self.staleness,
                self.retest_after_s,
            )
        return ok or not self.refuse

    def forget(self, worker_id: str) -> None:
        self.latency.pop(worker_id, None)
        self.too_slow.discard(worker_id)
