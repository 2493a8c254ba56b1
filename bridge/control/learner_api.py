"""The learner's side of the controller: staleness-aware batches and the checkpoint cursor.

`LearnerSide` is a part of `Controller` (bridge/control/controller.py), built from what it
needs: the database (bridge/control/db.py), the controller's lock, the staleness bound, the
clock, the lease timing it reports the learner's pace to, and the prompt stream. The
controller keeps the learner's entry points (`take_batch`, `wait_batch`, the cursor) and
delegates here; it adds the fleet metrics to each batch's stats.

Bounded staleness S (the rule: bridge/contracts/staleness.py): learner step t may use a
trajectory only while its oldest token's version is fresh. Before each batch, buffered groups that
already break this are dropped (counted in `staleness/dropped`, cumulative over the run)
and their prompts requeued; a group is judged by its stalest trajectory, since GRPO needs
it whole. Batches take the oldest version first (the earliest deadline: a group of version
v expires after step v + S), then the earliest arrival: a slow worker's group that arrives
behind fresher ones is used while it still can be, instead of being overtaken until stale.

Durability: `export_cursor` goes into the learner's orbax checkpoint; `restore_cursor`
returns groups consumed after that checkpoint to the buffer (their trajectories stay in
SQLite until `forget_consumed`), so a restart loses no accepted trajectory and consumes
none twice.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Callable

import pydantic

from bridge.contracts import staleness as staleness_rule
from bridge.control.db import ControllerDB
from bridge.control.lease_timing import LeaseTiming
from bridge.control.prompt_stream import PromptStream
from bridge.control.protocol import ConsumedGroup, Trajectory
from bridge.control.sampling_seeds import SamplingSeeds

# A group's payload (intake.py writes it with the same adapter): pydantic-core parses and
# validates it from the JSON text, ~10x `Trajectory(**t) for t in json.loads(...)`.
_TRAJECTORIES = pydantic.TypeAdapter(list[Trajectory])


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
        dtypes = {w: self.engine_dtype(w) for w in set(workers.values())}
        return [
            {**dict(r), "worker_id": (w := workers.get(r["lease_id"], "")),
             "engine_dtype": dtypes.get(w, "bfloat16")}
            for r in rows
        ]  # fmt: skip

    def engine_dtype(self, worker_id: str) -> str:
        """The engine dtype `worker_id` declared (its registered profile)."""
        row = self.db.worker(worker_id)
        profile = json.loads(row["profile"]) if row is not None else {}
        return str(profile.get("engine_dtype", "bfloat16"))

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
