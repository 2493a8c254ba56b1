"""The learner's calls on the controller (a part of `Controller`, controller.py, kept in
its own file): batches, the capacity model's learner reports, the checkpoint cursor,
the eval board's learner side (`evaluation`).

`Controller` provides `_op`, `lock`, `_new_work`, `_polling`, `_stats` (it takes the lock
itself), `learner`, `fleet`, `liveness`, `evals`, `db`, `auto_staleness` and
`set_staleness`; the batch logic itself is
learner_api.py's `LearnerSide`.
"""

from __future__ import annotations

import time

from bridge.control import rollback
from bridge.control.eval_leases import LEARNER_CALLS
from bridge.control.learner_api import build_batch
from bridge.control.protocol import ConsumedGroup

IDLE_STATS_S = 5.0


class LearnerCalls:
    def take_batch(self, step: int, num_groups: int) -> tuple[list[ConsumedGroup] | None, dict]:
        """`num_groups` fresh groups for `step`, oldest version first; None if too few yet.
        The stats are the fleet metrics, plus the batch's staleness when there is one (none
        on a miss inside `wait_batch`). Only taking the rows holds the lock: the fsync, the
        decoding and the stats come after it (`_batch_of`)."""
        with self._op(durable=False):
            rows = self.learner.take_rows(step, num_groups)
        if rows is None:
            return None, ({} if getattr(self._polling, "on", False) else self._fresh_stats())
        return self._batch_of(rows, step)

    def wait_batch(
        self, step: int, num_groups: int, timeout_s: float
    ) -> tuple[list[ConsumedGroup] | None, dict]:
        """Block until `take_batch` succeeds or `timeout_s` passes (wall clock). The fleet
        stats are computed once, on return (not on every submission's wake-up), and the
        consumption is on disk before the batch is. The stats carry `time/data_wait_s`, the
        seconds this call waited for work to arrive. The lock is not held across the tries
        (a step's fsync, decoding and stats held it ~100-300 ms at 500 workers): a
        submission accepted after a try's start (`_work_seq`) skips the wait instead."""
        deadline, waited = time.monotonic() + timeout_s, 0.0
        self._polling.on = True
        try:
            while True:
                seen = getattr(self, "_work_seq", 0)
                batch, stats = self.take_batch(step, num_groups)
                left = deadline - time.monotonic()
                if batch is not None or left <= 0:
                    break
                with self.lock:  # wake on submissions; poll anyway so expiry is noticed
                    if getattr(self, "_work_seq", 0) == seen:
                        t0 = time.monotonic()
                        self._new_work.wait(min(left, 0.5))
                        waited += time.monotonic() - t0
        finally:
            self._polling.on = False
        # The time there was no batch to take: the rest of the call (taking it, the fleet
        # stats, the fsync, the transfer) is the learner's own cost per step (capacity O).
        if batch is None:
            stats = self._idle_stats()
        stats = {**stats, "time/data_wait_s": waited}
        if self.auto_staleness is not None:
            # The learner polls with short timeouts: its wait for a step is every call's.
            if getattr(self, "_waits", (None, 0.0))[0] != step:
                self._waits = (step, 0.0)
            self._waits = (step, self._waits[1] + waited)
            if batch is not None:
                stats["staleness/bound"] = self._adapt_staleness(stats, self._waits[1])
        return batch, stats

    def _adapt_staleness(self, stats: dict, step_wait_s: float) -> int:
        """`staleness="auto"`: one batch's evidence moves S (auto_staleness.py)."""
        confident = stats.get("capacity/confident", 0)
        s = self.auto_staleness.observe(
            dropped_total=int(stats.get("staleness/dropped", 0)),
            data_wait_s=step_wait_s,
            step_s=float(stats.get("capacity/train_step_s") or 0.0),
            model_staleness=stats.get("capacity/min_staleness") if confident else None,
        )
        self.set_staleness(s)
        return s

    def _work_arrived(self) -> None:
        """A submission was accepted (lock held): wake a waiting `wait_batch`."""
        self._work_seq = getattr(self, "_work_seq", 0) + 1
        self._new_work.notify_all()

    def _batch_of(self, rows: list[dict], step: int) -> tuple[list[ConsumedGroup], dict]:
        """After the lock: the consumption on disk before the learner trains on it, then
        the batch decoded and the fleet stats (a short lock of their own)."""
        self.db.sync()
        batch, staleness = build_batch(rows, step, self.content.seeds)
        return batch, {**self._fresh_stats(), **staleness}

    def _fresh_stats(self) -> dict:
        return self._stats()  # its O(fleet) part off the lock (controller.py)

    def _idle_stats(self) -> dict:
        """The fleet stats of a wait that found no batch (the learner's timeout message),
        at most every IDLE_STATS_S: a learner polling each second recomputed them under
        the lock, O(fleet) (~17 ms at 2000 workers) while leases queued behind it."""
        at, stats = getattr(self, "_idle_stats_at", (float("-inf"), {}))
        if time.monotonic() - at >= IDLE_STATS_S:
            stats = self._fresh_stats()
            self._idle_stats_at = (time.monotonic(), stats)
        return stats

    def report_learner(
        self,
        step_s: float | None = None,
        publish_s: float | None = None,
        overhead_s: float | None = None,
        cold: bool = False,
    ):
        """The learner's train time of its last update (T for the capacity model; until it
        reports, the measured step period, waits included), on publishing steps the time to
        publish (0 or None: none this step), and its time outside train steps and waits
        since the previous update (evaluation, checkpoints, publishing). `cold`: XLA
        compiled since the previous report, a one-off: these times are left out while warm
        ones exist. Call after each RL step."""
        with self.lock:
            self.fleet.learner_reported(step_s, publish_s, overhead_s, cold)
            self.liveness.stepped(self.clock())

    def export_cursor(self) -> dict:
        return self.learner.export_cursor()

    def restore_cursor(self, cursor: dict, version: int | None = None) -> int:
        """Put the groups consumed after a checkpoint back in the buffer; with `version`
        (the checkpoint's), also undo what a crashed run did past it (control/rollback.py)."""
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

    def evaluation(self, call: str, *args, **kwargs):
        """The learner's side of the eval leases (eval_leases.py `LEARNER_CALLS`), one
        method so a controller in its own process (process.py) serves them too."""
        if call not in LEARNER_CALLS:
            raise ValueError(f"evaluation call must be one of {LEARNER_CALLS}, got {call!r}")
        out = getattr(self.evals, call)(*args, **kwargs)
        if call == "take_check_rows":  # the exact check's margin follows the engine's dtype
            dtypes = {r["worker"]: self.learner.engine_dtype(r["worker"]) for r in out}
            out = [{**r, "engine_dtype": dtypes[r["worker"]]} for r in out]
        return out
