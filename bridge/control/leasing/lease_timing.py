"""Freshness-aware leasing: give a worker only work it can return before it goes stale.

This is the paper's freshness condition (PAPER.md, capacity model) applied per worker and
measured live. A lease issued now at version v must come back within the deadline of
bridge/contracts/staleness.py (`lease_window_s`: the batches left for v times the step
period T, less the time since the last batch).

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

The refusal is said once per worker, with its price (issue 32: the demo said it at every
re-measuring, telling the user to do by hand what the fleet can do): a worker the training
binary started is put on standby and released by the fleet follower after
`standby_release_s` (learner_jax/rl/fleet.py); one started by hand is the operator's to stop.
"""

from __future__ import annotations

import dataclasses
import logging

from bridge.contracts import staleness as staleness_rule

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
        self._warned: set[str] = set()  # workers whose refusal was said (once each)
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
        return staleness_rule.lease_window_s(
            worker_version, next_step, self.staleness, period, since
        )

    def until_next_batch_s(self, now: float) -> float:
        """Seconds until the learner's next batch is due at its measured pace (0 when unknown
        or overdue). Until then a lease's window only shrinks, so a worker refused as too
        slow cannot be admitted sooner: asking again before then is only load."""
        if self.step_period_s is None or self.last_batch_at is None:
            return 0.0
        return max(0.0, self.last_batch_at + self.step_period_s - now)

    def fresh_enough(self, worker_id: str, worker_version: int, next_step: int, now: float):
        """(ok, latency, window): False only on a recent late lease and a too-long latency."""
        lat, window = self.latency.get(worker_id), self.window_s(worker_version, next_step, now)
        if lat is not None and now - lat.measured_at > self.retest_after_s:
            del self.latency[worker_id]  # too old: lease once more to measure again
            lat = None
        ok = lat is None or window is None or not lat.late or lat.seconds <= window
        (self.too_slow.discard if ok else self.too_slow.add)(worker_id)
        return ok, (lat.seconds if lat else None), window

    def admit(
        self,
        worker_id: str,
        worker_version: int,
        next_step: int,
        now: float,
        price_per_hour: float = 0.0,
    ) -> bool:
        """`fresh_enough`, warning once about a too-slow worker; True if not `refuse`."""
        ok, latency, window = self.fresh_enough(worker_id, worker_version, next_step, now)
        # Said once per worker: a borderline worker flips at every step, and a refused one is
        # re-measured every retest_after_s; the status table and the live line keep count.
        if not ok and worker_id not in self._warned:
            self._warned.add(worker_id)
            logging.warning(
                "worker %s %s: its leases take %.2fs but must be back within %.2fs "
                "(staleness %d at the learner's current pace), and it is billed $%.2f/h "
                "meanwhile. A worker this run started is released after "
                "fleet.standby_release_s; one started by hand: raise staleness or stop it "
                "(re-measured every %.0fs; said once).",
                worker_id,
                "gets no work for now" if self.refuse else "returns work too late",
                latency,
                window,
                self.staleness,
                price_per_hour,
                self.retest_after_s,
            )
        return ok or not self.refuse

    def forget(self, worker_id: str) -> None:
        self.latency.pop(worker_id, None)
        self.too_slow.discard(worker_id)
