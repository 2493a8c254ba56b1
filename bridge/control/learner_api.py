"""The learner's side of the controller: staleness-aware batches and the checkpoint cursor.

A mixin of `Controller` (bridge/control/controller.py), which supplies `config`, `store` (SQLite),
`lock`, `_op()` (lock + transaction), `clock` and `_expire`.

Bounded staleness S: version v = parameters after v updates; learner step t may use a
trajectory only if t - v <= S for its oldest token. Before each batch, buffered groups that
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

import itertools
import json
import time

from bridge.control.protocol import ConsumedGroup, Trajectory


class LearnerSide:
    """Methods the learner calls in-process (never exposed over HTTP)."""

    def _drop_stale(self, step: int) -> int:
        stale = self.store.q(
            "SELECT group_id FROM groups WHERE state='buffered' AND ? - min_version > ?",
            (step, self.config.staleness),
        )
        if stale:
            self.store.requeue([r["group_id"] for r in stale])
            self.store.incr("staleness/dropped", len(stale))
        return len(stale)

    def take_batch(self, step: int, num_groups: int) -> tuple[list[ConsumedGroup] | None, dict]:
        """`num_groups` fresh groups for `step`, oldest version first; None if too few yet."""
        with self._op():
            self._expire(self.clock())
            self.store.put("next_step", step)
            self._drop_stale(step)
            rows = self.store.q(
                "SELECT * FROM groups WHERE state='buffered'"
                " ORDER BY min_version, accepted_at, group_id LIMIT ?",
                (num_groups,),
            )
            if len(rows) < num_groups:
                return None, self._stats()
            self.store.set_state([r["group_id"] for r in rows], "consumed", consumed_step=step)
            self.store.put("next_step", step + 1)
            self.store.put("consumed_through_step", step)
            self.store.incr("groups/consumed", len(rows))
            self.timing.batch_taken(self.clock())
            batch = [
                ConsumedGroup(
                    group_id=r["group_id"],
                    prompt_id=r["prompt_id"],
                    prompt=r["prompt"],
                    answer=r["answer"],
                    trajectories=[Trajectory(**t) for t in json.loads(r["payload"])],
                )
                for r in rows
            ]
            lags = [step - t.min_version for g in batch for t in g.trajectories]
            stats = self._stats()
            stats.update({"staleness/mean": sum(lags) / len(lags), "staleness/max": max(lags)})
            return batch, stats

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
        """JSON-able state for the learner's checkpoint."""
        with self.lock:
            return {
                "next_step": self.store.get("next_step", 0),
                "consumed_through_step": self.store.get("consumed_through_step", -1),
                "prompts_drawn": self.store.get("prompts_drawn", 0),
            }

    def restore_cursor(self, cursor: dict) -> int:
        """Undo consumption after the checkpoint; returns how many groups went back."""
        with self._op():
            n = self.store.revert_consumed_after(cursor["consumed_through_step"])
            self.store.put("next_step", cursor["next_step"])
            self.store.put("consumed_through_step", cursor["consumed_through_step"])
            drawn = self.store.get("prompts_drawn", 0)
            # A database older than the checkpoint (or a fresh one): skip the prompts the
            # checkpointed run already drew instead of training on them again.
            if cursor["prompts_drawn"] > drawn:
                for _ in itertools.islice(self._prompts, cursor["prompts_drawn"] - drawn):
                    pass
                self.store.put("prompts_drawn", cursor["prompts_drawn"])
            self.store.incr("groups/consumed", -n)
            return n

    def forget_consumed(self, up_to_step: int) -> int:
        """Free consumed trajectories once a checkpoint at or after `up_to_step` is durable."""
        with self._op():
            return self.store.forget_consumed(up_to_step)
