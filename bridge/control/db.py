"""SQLite (WAL) persistence of the controller: workers, prompt groups, leases, counters.

Every controller operation is one transaction (`with store.tx():`), so a crash leaves
either all or none of it. A group's life is one row whose `state` moves

    queued -> leased -> buffered (trajectories accepted) -> consumed (at a learner step)
       ^        |          |
       +--------+----------+  (lease expired / released, or dropped as too stale)

Accepted trajectories live in `payload` (JSON) until the learner has checkpointed the step
that consumed them (`forget_consumed`), so a learner restored from an older checkpoint can
take them again (`revert_consumed_after`). `synchronous=FULL`: an accepted submission
survives a power cut, not only a process crash.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS workers (
  worker_id TEXT PRIMARY KEY, token_hash TEXT UNIQUE NOT NULL, profile TEXT NOT NULL,
  registered_at REAL NOT NULL, last_seen REAL NOT NULL, version INTEGER NOT NULL DEFAULT -1,
  samples_per_s REAL NOT NULL DEFAULT 0, tokens_per_s REAL NOT NULL DEFAULT 0,
  active_s REAL NOT NULL DEFAULT 0, enabled INTEGER NOT NULL DEFAULT 1,
  left_at REAL);
CREATE TABLE IF NOT EXISTS groups (
  group_id INTEGER PRIMARY KEY AUTOINCREMENT, prompt_id TEXT NOT NULL, prompt TEXT NOT NULL,
  answer TEXT NOT NULL, state TEXT NOT NULL, lease_id TEXT, payload TEXT,
  min_version INTEGER, accepted_at REAL, consumed_step INTEGER,
  attempts INTEGER NOT NULL DEFAULT 0);
CREATE INDEX IF NOT EXISTS groups_state ON groups(state, group_id);
CREATE INDEX IF NOT EXISTS groups_lease ON groups(lease_id);
CREATE TABLE IF NOT EXISTS leases (
  lease_id TEXT PRIMARY KEY, worker_id TEXT NOT NULL, created_at REAL NOT NULL,
  expires_at REAL NOT NULL, state TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS leases_state ON leases(state, expires_at);
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class ControllerStore:
    """Thin typed access to the tables; the caller serializes access (one lock)."""

    def __init__(self, path: str):
        self.path = path
        # isolation_level=None: we open transactions ourselves with BEGIN IMMEDIATE.
        self.conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=FULL")
        self.conn.executescript(_SCHEMA)

    def close(self) -> None:
        self.conn.close()

    @contextlib.contextmanager
    def tx(self):
        if self.conn.in_transaction:  # nested: the outer transaction owns commit/rollback
            yield
            return
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def q(self, sql: str, args: tuple | list = ()) -> list[sqlite3.Row]:
        return self.conn.execute(sql, args).fetchall()

    def x(self, sql: str, args: tuple | list = ()) -> int:
        return self.conn.execute(sql, args).rowcount

    # -- key/value: counters, cursor, announcement ---------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        rows = self.q("SELECT value FROM kv WHERE key=?", (key,))
        return json.loads(rows[0]["value"]) if rows else default

    def put(self, key: str, value: Any) -> None:
        self.x("INSERT OR REPLACE INTO kv(key, value) VALUES (?, ?)", (key, json.dumps(value)))

    def incr(self, key: str, n: float = 1) -> None:
        self.put(key, self.get(key, 0) + n)

    # -- groups --------------------------------------------------------------------------
    def add_groups(self, prompts: list[tuple[str, str, str]]) -> None:
        self.conn.executemany(
            "INSERT INTO groups(prompt_id, prompt, answer, state) VALUES (?, ?, ?, 'queued')",
            prompts,
        )

    def count(self, state: str) -> int:
        return self.q("SELECT COUNT(*) AS n FROM groups WHERE state=?", (state,))[0]["n"]

    def groups_in(self, state: str, limit: int = -1) -> list[sqlite3.Row]:
        return self.q(
            "SELECT * FROM groups WHERE state=? ORDER BY group_id LIMIT ?", (state, limit)
        )

    def groups_of_lease(self, lease_id: str) -> list[sqlite3.Row]:
        return self.q("SELECT * FROM groups WHERE lease_id=? ORDER BY group_id", (lease_id,))

    def set_state(self, group_ids: list[int], state: str, **cols: Any) -> None:
        sets = ", ".join(["state=?"] + [f"{k}=?" for k in cols])
        self.conn.executemany(
            f"UPDATE groups SET {sets} WHERE group_id=?",
            [(state, *cols.values(), g) for g in group_ids],
        )

    def requeue(self, group_ids: list[int]) -> None:
        """Back to the queue (the same row, so it goes out before newer prompts)."""
        self.conn.executemany(
            "UPDATE groups SET state='queued', lease_id=NULL, payload=NULL, min_version=NULL,"
            " accepted_at=NULL, consumed_step=NULL, attempts=attempts+1 WHERE group_id=?",
            [(g,) for g in group_ids],
        )

    def revert_consumed_after(self, step: int) -> int:
        return self.x(
            "UPDATE groups SET state='buffered', consumed_step=NULL"
            " WHERE state='consumed' AND consumed_step>? AND payload IS NOT NULL",
            (step,),
        )

    def forget_consumed(self, up_to_step: int) -> int:
        return self.x(
            "DELETE FROM groups WHERE state='consumed' AND consumed_step<=?", (up_to_step,)
        )

    # -- leases --------------------------------------------------------------------------
    def add_lease(self, lease_id: str, worker_id: str, now: float, expires_at: float) -> None:
        self.x(
            "INSERT INTO leases(lease_id, worker_id, created_at, expires_at, state)"
            " VALUES (?, ?, ?, ?, 'active')",
            (lease_id, worker_id, now, expires_at),
        )

    def lease(self, lease_id: str) -> sqlite3.Row | None:
        rows = self.q("SELECT * FROM leases WHERE lease_id=?", (lease_id,))
        return rows[0] if rows else None

    def set_lease_state(self, lease_id: str, state: str) -> None:
        self.x("UPDATE leases SET state=? WHERE lease_id=?", (state, lease_id))

    # -- workers -------------------------------------------------------------------------
    def worker(self, worker_id: str) -> sqlite3.Row | None:
        rows = self.q("SELECT * FROM workers WHERE worker_id=?", (worker_id,))
        return rows[0] if rows else None

    def update_worker(self, worker_id: str, **cols: Any) -> None:
        sets = ", ".join(f"{k}=?" for k in cols)
        self.x(f"UPDATE workers SET {sets} WHERE worker_id=?", (*cols.values(), worker_id))
