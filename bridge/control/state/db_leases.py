"""Leases: the row is durable, the deadline lives in memory (issue 25).

A lease's grant (`add_lease`) and its end (`set_lease_state` / `end_lease`: done,
released, expired, rolled back) are rows written in the operation's transaction and synced
before the reply (group commit, bridge/control/state/group_commit.py). Its deadline is not: every
heartbeat moves it (`renew_leases`), so it lives in `LeaseDeadlines`, in memory, and reaches
the row's `expires_at` only when the controller persists its hot state (`persist_deadlines`,
at most `hot_flush_s` apart; bridge/control/state/hot_state.py). A heartbeat touches no SQLite.

The episodes a lease's worker has played turn by turn (bridge/control/intake/episode_steps.py) are
rows keyed by the lease, written in the operation's transaction and deleted when it ends.

Restart (kill -9): `restore_deadlines(not_before)` reloads every active lease from its row
with the deadline max(persisted `expires_at`, `not_before`); the controller passes its
start time + `lease_ttl_s`. Conservative on purpose: the persisted deadline may be one flush
interval older than the last renewal, and no worker could heartbeat while the controller
was down, so every lease that was granted stays valid for a full TTL after the restart.

Consistency with the transaction: grants, ends and expiries made inside `db.tx()` are
journaled and undone if the transaction rolls back. Expiry takes a lease out of the table
(`expired`) under the table's own lock, the same one a heartbeat's renewal takes, so a lease
is either renewed or expired, never both: a heartbeat's reply lists only the leases it
renewed, and one it did not renew (past its deadline or its age cap) is ended by the next
sweep (any lease, submit, batch or periodic flush), its groups requeued.
"""

from __future__ import annotations

import json
import math
import threading


class LeaseDeadlines:
    """lease_id -> [worker_id, created_at, expires_at] of every active lease, in memory."""

    def __init__(self):
        self._lock = threading.Lock()
        self._rows: dict[str, list] = {}
        self._of: dict[str, set[str]] = {}  # worker_id -> its active lease ids
        self._dirty: set[str] = set()  # deadlines not yet persisted
        self._too_old: set[str] = set()  # past their age cap (lease_caps.py): expire next
        self._earliest = math.inf  # a lower bound of every deadline (skips most scans)
        self._undo: list | None = None  # in a transaction: (lease_id, row to put back)

    # -- transaction journal (ControllerDB.tx) -------------------------------------------
    def begin(self) -> None:
        with self._lock:
            self._undo = []

    def commit(self) -> None:
        with self._lock:
            self._undo = None

    def rollback(self) -> None:
        with self._lock:
            undo, self._undo = self._undo or [], None
            for lease_id, row in reversed(undo):
                self._pop(lease_id) if row is None else self._put(lease_id, row)

    def _put(self, lease_id: str, row: list) -> None:
        self._rows[lease_id] = row
        self._of.setdefault(row[0], set()).add(lease_id)
        self._earliest = min(self._earliest, row[2])

    def _pop(self, lease_id: str) -> list | None:
        row = self._rows.pop(lease_id, None)
        if row is not None:
            mine = self._of.get(row[0], set())
            mine.discard(lease_id)
            if not mine:
                self._of.pop(row[0], None)
            if self._undo is not None:
                self._undo.append((lease_id, list(row)))
        self._dirty.discard(lease_id)
        self._too_old.discard(lease_id)
        return row

    # -- the table -----------------------------------------------------------------------
    def granted(self, lease_id: str, worker_id: str, created_at: float, expires_at: float):
        with self._lock:
            self._put(lease_id, [worker_id, created_at, expires_at])
            if self._undo is not None:
                self._undo.append((lease_id, None))

    def ended(self, lease_id: str) -> None:
        with self._lock:
            self._pop(lease_id)

    def active(self, worker_id: str) -> list[str]:
        with self._lock:
            return sorted(self._of.get(worker_id, ()))

    def deadline(self, lease_id: str) -> float | None:
        with self._lock:
            row = self._rows.get(lease_id)
            return None if row is None else row[2]

    def renew(self, worker_id: str, now: float, expires_at: float, max_age_s=math.inf):
        """Move the deadline of each of `worker_id`'s live leases to at least `expires_at`;
        one older than `max_age_s` is marked to expire instead. Returns the renewed ids."""
        renewed = []
        with self._lock:
            for lease_id in sorted(self._of.get(worker_id, ())):
                row = self._rows[lease_id]
                if row[2] < now or lease_id in self._too_old:
                    continue  # already past: the next sweep ends it
                if now - row[1] > max_age_s:
                    self._too_old.add(lease_id)
                    row[2] = min(row[2], now - 1e-9)
                    self._earliest = min(self._earliest, row[2])
                    continue
                row[2] = max(row[2], expires_at)
                self._dirty.add(lease_id)
                renewed.append(lease_id)
        return renewed

    def expired(self, now: float) -> list[tuple[str, bool]]:
        """Take out every lease whose deadline passed before `now`: (lease_id, too_old)."""
        with self._lock:
            if now <= self._earliest:
                return []
            out = [(lid, lid in self._too_old) for lid, r in self._rows.items() if r[2] < now]
            for lease_id, _ in out:
                self._pop(lease_id)
            self._earliest = min((r[2] for r in self._rows.values()), default=math.inf)
            return out

    def take_dirty(self) -> list[tuple[float, str]]:
        """(expires_at, lease_id) of every deadline moved since the last call."""
        with self._lock:
            out = [(self._rows[lid][2], lid) for lid in self._dirty if lid in self._rows]
            self._dirty.clear()
            return out

    def restore(self, rows, not_before: float) -> None:
        """Replace the table by `rows` (lease_id, worker_id, created_at, expires_at), each
        deadline at least `not_before`."""
        with self._lock:
            self._rows.clear(), self._of.clear(), self._dirty.clear(), self._too_old.clear()
            self._earliest = math.inf
            for lease_id, worker_id, created_at, expires_at in rows:
                self._put(lease_id, [worker_id, created_at, max(expires_at, not_before)])
                self._dirty.add(lease_id)


class LeaseRows:
    """The lease statements of `ControllerDB` (db.py), which provides `_x`, `q`, `incr`,
    `conn`, `groups_of_lease`, `requeue` and `deadlines` (a `LeaseDeadlines`)."""

    def add_lease(self, lease_id: str, worker_id: str, now: float, expires_at: float) -> None:
        self._x(
            "INSERT INTO leases(lease_id, worker_id, created_at, expires_at, state)"
            " VALUES (?, ?, ?, ?, 'active')",
            (lease_id, worker_id, now, expires_at),
        )
        self.deadlines.granted(lease_id, worker_id, now, expires_at)

    def lease(self, lease_id: str):
        rows = self.q("SELECT * FROM leases WHERE lease_id=?", (lease_id,))
        return rows[0] if rows else None

    def lease_workers(self, lease_ids: list[str]) -> dict[str, str]:
        """lease_id -> worker_id of `lease_ids`, in one statement (any number of ids)."""
        rows = self.q(
            "SELECT lease_id, worker_id FROM leases"
            " WHERE lease_id IN (SELECT value FROM json_each(?))",
            (json.dumps(sorted(set(lease_ids))),),
        )
        return {r["lease_id"]: r["worker_id"] for r in rows}

    def active_leases(self, worker_id: str) -> list[str]:
        """Ids of the leases `worker_id` holds now."""
        rows = self.q(
            "SELECT lease_id FROM leases WHERE worker_id=? AND state='active'", (worker_id,)
        )
        return [r["lease_id"] for r in rows]

    def renew_leases(self, worker_id: str, expires_at: float, now: float = -math.inf) -> None:
        """Every active lease of `worker_id` not past its deadline at `now` lives at least
        until `expires_at` (in memory: persisted with the hot state)."""
        self.deadlines.renew(worker_id, now, expires_at)

    def set_lease_state(self, lease_id: str, state: str) -> None:
        self._x("UPDATE leases SET state=? WHERE lease_id=?", (state, lease_id))
        if state != "active":
            self.deadlines.ended(lease_id)
            self._x("DELETE FROM episodes WHERE lease_id=?", (lease_id,))  # nothing to check

    # -- the episodes a lease's worker has played (bridge/control/intake/episode_steps.py) -------
    def episode_states(self, lease_id: str) -> dict[tuple[int, int], tuple]:
        """(group_id, sample_index) -> (turns, last observation, done, what each turn's
        step drew) of every episode of `lease_id` with a committed turn."""
        rows = self.q(
            "SELECT group_id, sample_index, turns, observation, done, drawn FROM episodes"
            " WHERE lease_id=?",
            (lease_id,),
        )
        return {
            (r["group_id"], r["sample_index"]): (json.loads(r["turns"]), r["observation"],
                                                 bool(r["done"]), json.loads(r["drawn"]))
            for r in rows
        }  # fmt: skip

    def put_episode_states(self, lease_id: str, states: dict[tuple[int, int], tuple]) -> None:
        self.conn.executemany(
            "INSERT OR REPLACE INTO episodes(lease_id, group_id, sample_index, turns,"
            " observation, done, drawn) VALUES (?, ?, ?, ?, ?, ?, ?)",
            [
                (lease_id, gid, i, json.dumps(turns), obs, int(done), json.dumps(drawn))
                for (gid, i), (turns, obs, done, drawn) in states.items()
            ],
        )

    def end_lease(self, lease_id: str, state: str) -> None:
        """End a lease as `state` (expired, released): its unsubmitted groups requeue."""
        rows = self.groups_of_lease(lease_id)
        self.requeue([r["group_id"] for r in rows if r["state"] == "leased"])
        self.set_lease_state(lease_id, state)
        self.incr(f"leases/{state}")

    def expire_leases(self, now: float) -> None:
        """End every active lease whose deadline passed before `now` (one past its age cap
        also counts in `leases/too_old`)."""
        for lease_id, too_old in self.deadlines.expired(now):
            self.end_lease(lease_id, "expired")
            if too_old:
                self.incr("leases/too_old")

    def persist_deadlines(self) -> None:
        """Write the deadlines moved since the last call (a restart reads them back)."""
        self.conn.executemany(
            "UPDATE leases SET expires_at=? WHERE lease_id=? AND state='active'",
            self.deadlines.take_dirty(),
        )

    def restore_deadlines(self, not_before: float) -> None:
        """Load every active lease's deadline from its row, at least `not_before`."""
        rows = self.q(
            "SELECT lease_id, worker_id, created_at, expires_at FROM leases WHERE state='active'"
        )
        self.deadlines.restore([tuple(r) for r in rows], not_before)
