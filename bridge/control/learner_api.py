"""The learner's side of the controller: staleness-aware batches, the wait for one, and the
checkpoint cursor.

`LearnerSide` is a part of `Controller` (bridge/control/controller.py), built from what it
needs: the database (bridge/control/state/db.py), the controller's lock, the staleness
bound, the clock, the lease timing it reports the learner's pace to, and the prompt stream.
The controller keeps the learner's entry points (`take_batch`, `wait_batch`, the cursor) and
delegates here; it adds the fleet metrics to each batch's stats.

Waiting (`wait_for_batch`): the lock is not held across the tries (a step's fsync, decoding
and stats held it ~100-300 ms at 500 workers). A waiting learner is woken only when a batch
may be there: an accepted submission (`work_arrived`) reads the buffered count in its own
transaction and bumps a counter and wakes the learner once that count reaches what it waits
for. Each submission woke it before, and each wake-up was a try that took the controller's
lock twice and a write transaction and missed (up to one per submission, on the path every
lease queues on). The wait is on a condition of its own, not the controller's lock's; the
counter makes a wake-up between a try and the sleep count.

Bounded staleness S (the rule: bridge/contracts/staleness.py): learner step t may use a
trajectory only while its oldest token's version is fresh. Before each batch, buffered groups that
already break this are dropped (counted in `staleness/dropped`, cumulative over the run)
and their prompts requeued; a group is judged by its stalest trajectory, since GRPO needs
it whole (with partial rollouts by its newest token within a cap: the version intake.py
buffers as its `min_version`, bridge/contracts/staleness.py `group_version`). Batches take
the oldest version first (the earliest deadline: a group of version v expires after step
v + S), then the earliest arrival: a slow worker's group that arrives
behind fresher ones is used while it still can be, instead of being overtaken until stale.

Durability: `export_cursor` goes into the learner's orbax checkpoint; `restore_cursor`
returns groups consumed after that checkpoint to the buffer (their trajectories stay in
SQLite until `forget_consumed`), so a restart loses no accepted trajectory and consumes
none twice.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable

import pydantic

from bridge.contracts import staleness as staleness_rule
from bridge.control.leasing.lease_timing import LeaseTiming
from bridge.control.leasing.prompt_stream import PromptStream
from bridge.control.leasing.sampling_seeds import SamplingSeeds
from bridge.control.protocol import ConsumedGroup, Trajectory
from bridge.control.state.db import ControllerDB

# A group's payload (intake.py writes it with the same adapter): pydantic-core parses and
# validates it from the JSON text, ~10x `Trajectory(**t) for t in json.loads(...)`.
_TRAJECTORIES = pydantic.TypeAdapter(list[Trajectory])
# The fleet stats of a wait that found no batch are recomputed at most this often: a learner
# polling each second recomputed them under the lock, O(fleet) (~17 ms at 2000 workers),
# while leases queued behind it.
IDLE_STATS_S = 5.0
# A waiting learner tries again at least this often, woken or not: leases past their
# deadline requeue their groups and stale groups drop only when someone looks.
RETRY_S = 0.5

Batch = tuple[list[ConsumedGroup] | None, dict]


class LearnerSide:
    """What the learner calls in-process (never exposed over HTTP); each call is atomic."""

    def __init__(
        self,
        db: ControllerDB,
        lock: threading.RLock,
        staleness: int,
        clock: Callable[[], float],
        timing: LeaseTiming,
        prompts: PromptStream,
    ):
        self.db, self.lock, self.staleness, self.clock = db, lock, staleness, clock
        self.timing, self.prompts = timing, prompts
        self._new_work = threading.Condition()  # not the controller's lock: see module doc
        self._work_seq = 0  # times a waiting learner's batch may have become ready
        self._wanted: list[int] = []  # the batch size of each waiting learner
        self._polling = threading.local()  # inside `wait_for_batch` on this thread
        self._idle_stats: tuple[float, dict] = (-math.inf, {})  # (monotonic time, stats)

    @contextlib.contextmanager
    def _op(self):
        with self.lock, self.db.tx():
            yield

    def drop_stale(self, step: int) -> int:
        """Requeue buffered groups too stale for learner step `step`; returns how many."""
        with self._op():
            stale = self.db.stale_buffered(staleness_rule.oldest_fresh(step, self.staleness))
            if stale:
                self.db.record_dropped(stale, step)
                self.db.requeue(stale)
                self.db.incr("staleness/dropped", len(stale))
            return len(stale)

    def take_batch(self, step: int, num_groups: int) -> tuple[list[ConsumedGroup] | None, dict]:
        """`num_groups` fresh groups for `step`, oldest version first, and their staleness
        stats; (None, {}) if too few yet."""
        with self._op():
            rows = self.take_rows(step, num_groups)
        return (None, {}) if rows is None else build_batch(rows, step)

    def take_rows(self, step: int, num_groups: int) -> list[dict] | None:
        """The atomic part of `take_batch` (caller holds the lock and the transaction): mark
        `num_groups` fresh groups consumed at `step` and return their rows (with the worker
        that generated each), or None if too few yet. Only SQL: the rows become a batch in
        `build_batch`, outside the lock (decoding 256 groups' trajectories held the lock
        ~100 ms per step at 500 workers; issue 25, stop 36)."""
        self.db.expire_leases(self.clock())
        self.db.put("next_step", step)
        self.drop_stale(step)
        if self.db.count("buffered") < num_groups:  # a miss reads no payloads
            return None
        rows = self.db.oldest_buffered(num_groups)
        self.db.set_state([r["group_id"] for r in rows], "consumed", consumed_step=step)
        self.db.put("next_step", step + 1)
        self.db.put("consumed_through_step", step)
        self.db.incr("groups/consumed", len(rows))
        self.timing.batch_taken(self.clock())
        workers = self.db.lease_workers([r["lease_id"] for r in rows if r["lease_id"]])
        dtypes = self.db.engine_dtypes(set(workers.values()))  # one statement, any number
        return [
            {**dict(r), "worker_id": (w := workers.get(r["lease_id"], "")),
             "engine_dtype": dtypes.get(w, "bfloat16")}
            for r in rows
        ]  # fmt: skip

    def work_arrived(self, buffered: Callable[[], int]) -> None:
        """A submission was accepted (the caller holds the lock and its transaction): wake
        `wait_for_batch` if `buffered()` (the buffered groups now) reaches a waiting
        learner's batch. With no learner waiting nothing is read."""
        wanted = self._wanted  # changed only under the condition; read under the lock is
        if wanted and buffered() >= min(wanted):  # ordered with the learner's tries
            with self._new_work:
                self._work_seq += 1
                self._new_work.notify_all()

    def polling(self) -> bool:
        """Whether this thread is inside `wait_for_batch`: a miss there needs no fleet
        stats (they are computed once, when the wait returns)."""
        return getattr(self._polling, "on", False)

    def wait_for_batch(
        self,
        take: Callable[[], Batch],
        timeout_s: float,
        stats: Callable[[], dict],
        num_groups: int = 1,
    ) -> Batch:
        """`take()` (the controller's `take_batch` of `num_groups` for one step) until it
        returns a batch or `timeout_s` passes (wall clock), sleeping in between until the
        buffer holds `num_groups` (`work_arrived`) or RETRY_S passes. On a timeout the stats
        are `stats()` at most every IDLE_STATS_S. Adds `time/data_wait_s`, the seconds spent
        waiting for work to arrive: the rest of the call (taking the batch, the fleet stats,
        the fsync, the transfer) is the learner's own cost per step (capacity O)."""
        deadline, waited = time.monotonic() + timeout_s, 0.0
        self._polling.on = True
        with self._new_work:
            self._wanted.append(num_groups)
        try:
            while True:
                seen = self._work_seq
                batch, out = take()
                left = deadline - time.monotonic()
                if batch is not None or left <= 0:
                    break
                with self._new_work:  # woken when a batch may be there
                    if self._work_seq == seen:
                        t0 = time.monotonic()
                        self._new_work.wait(min(left, RETRY_S))
                        waited += time.monotonic() - t0
        finally:
            self._polling.on = False
            with self._new_work:
                self._wanted.remove(num_groups)
        if batch is None:
            at, out = self._idle_stats
            if time.monotonic() - at >= IDLE_STATS_S:
                out = stats()
                self._idle_stats = (time.monotonic(), out)
        return batch, {**out, "time/data_wait_s": waited}

    def engine_dtype(self, worker_id: str) -> str:
        """The engine dtype `worker_id` declared (its registered profile)."""
        return self.db.engine_dtypes({worker_id}).get(worker_id, "bfloat16")

    def export_cursor(self) -> dict:
        """JSON-able state for the learner's checkpoint."""
        with self.lock:
            return {
                "next_step": self.db.get("next_step", 0),
                "consumed_through_step": self.db.get("consumed_through_step", -1),
                "prompts_drawn": self.db.get("prompts_drawn", 0),
            }

    def restore_cursor(self, cursor: dict) -> int:
        """Undo consumption after the checkpoint; returns how many groups went back."""
        with self._op():
            n = self.db.revert_consumed_after(cursor["consumed_through_step"])
            self.db.put("next_step", cursor["next_step"])
            self.db.put("consumed_through_step", cursor["consumed_through_step"])
            # A database older than the checkpoint (or a fresh one): skip the prompts the
            # checkpointed run already drew instead of training on them again.
            self.prompts.skip_to(cursor["prompts_drawn"])
            self.db.incr("groups/consumed", -n)
            return n

    def forget_consumed(self, up_to_step: int) -> int:
        """Free consumed trajectories once a checkpoint at or after `up_to_step` is durable."""
        with self._op():
            return self.db.forget_consumed(up_to_step)


def build_batch(
    rows: list[dict], step: int, seeds: SamplingSeeds | None = None
) -> tuple[list[ConsumedGroup], dict]:
    """The batch of rows `take_rows` consumed, and its staleness stats (no lock needed:
    consumed rows change only by the learner's own calls); `seeds` gives each group the
    sampling seed of the lease that delivered it."""
    batch = [
        ConsumedGroup(
            group_id=r["group_id"],
            prompt_id=r["prompt_id"],
            prompt=r["prompt"],
            answer=r["answer"],
            trajectories=_TRAJECTORIES.validate_json(r["payload"]),
            worker_id=r["worker_id"],
            engine_dtype=r.get("engine_dtype", "bfloat16"),
            sampling_seed=(
                -1
                if seeds is None or not r["lease_id"]
                else seeds.seed(r["lease_id"], r["group_id"])
            ),
        )
        for r in rows
    ]
    lags = [step - t.min_version for g in batch for t in g.trajectories]
    return batch, {"staleness/mean": sum(lags) / len(lags), "staleness/max": max(lags)}
