"""SQLite (WAL) persistence of the controller: workers, prompt groups, leases, counters, fleet plan.

Every SQL statement of the controller is here, as a named method; controller.py and
learner_api.py call these and hold no SQL. Every controller operation is one transaction
(`with db.tx():`), so a crash leaves either all or none of it. A group's life is one row
whose `state` moves

    queued -> leased -> buffered (trajectories accepted) -> consumed (at a learner step)
       ^        |          |
       +--------+----------+  (lease expired / released, or dropped as too stale)

Accepted trajectories live in `payload` (JSON) until the learner has checkpointed the step
that consumed them (`forget_consumed`), so a learner restored from an older checkpoint can
take them again (`revert_consumed_after`).

Group commit (issue 25): `synchronous=NORMAL` (a COMMIT writes the WAL, no fsync) and
`sync()` after the transaction, outside the controller's lock: the first caller fsyncs the
WAL for every commit made so far and the callers that arrive meanwhile wait for it or the
next, so N submissions in a few ms cost one fsync (`GroupCommit`). What the controller
acknowledges (a lease, an acceptance, a registration) is on disk before its reply, as with
`synchronous=FULL`. A heartbeat touches no table at all: last contact, gauges and lease
deadlines are hot state in memory, persisted in batches (bridge/control/state/hot_state.py,
db_leases.py). Reads that need no transaction can use a per-thread read-only connection.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sqlite3
import threading
from typing import Any

from bridge.control.state.db_leases import LeaseDeadlines, LeaseRows
from bridge.control.state.group_commit import Checkpointer, GroupCommit

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
CREATE INDEX IF NOT EXISTS leases_worker ON leases(worker_id, state);
CREATE TABLE IF NOT EXISTS episodes (
  lease_id TEXT NOT NULL, group_id INTEGER NOT NULL, sample_index INTEGER NOT NULL,
  turns TEXT NOT NULL, observation TEXT NOT NULL, done INTEGER NOT NULL,
  drawn TEXT NOT NULL DEFAULT '[]',
  PRIMARY KEY (lease_id, group_id, sample_index)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS dropped (
  group_id INTEGER NOT NULL, prompt_id TEXT NOT NULL, step INTEGER NOT NULL,
  min_version INTEGER NOT NULL, worker_id TEXT, lengths TEXT NOT NULL, rewards TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS dropped_group ON dropped(group_id, worker_id);
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS fleet (
  worker_id TEXT PRIMARY KEY, standby INTEGER NOT NULL DEFAULT 0,
  changed_at REAL NOT NULL DEFAULT 0, standby_s REAL NOT NULL DEFAULT 0, rollouts_per_s REAL);
CREATE TABLE IF NOT EXISTS audit (
  worker_id TEXT PRIMARY KEY, k3 REAL NOT NULL, lr REAL NOT NULL, n REAL NOT NULL,
  total REAL NOT NULL, dev REAL NOT NULL DEFAULT 0, var REAL NOT NULL DEFAULT 0,
  cusum REAL NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS quarantine (
  worker_id TEXT PRIMARY KEY, at REAL NOT NULL, why TEXT NOT NULL,
  dropped_groups INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS group_counts (state TEXT PRIMARY KEY, n INTEGER NOT NULL)
  WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS group_counts_insert AFTER INSERT ON groups BEGIN
  INSERT INTO group_counts(state, n) VALUES (NEW.state, 1)
    ON CONFLICT(state) DO UPDATE SET n = n + 1;
END;
CREATE TRIGGER IF NOT EXISTS group_counts_delete AFTER DELETE ON groups BEGIN
  UPDATE group_counts SET n = n - 1 WHERE state = OLD.state;
END;
CREATE TRIGGER IF NOT EXISTS group_counts_update AFTER UPDATE OF state ON groups
  WHEN OLD.state IS NOT NEW.state BEGIN
  UPDATE group_counts SET n = n - 1 WHERE state = OLD.state;
  INSERT INTO group_counts(state, n) VALUES (NEW.state, 1)
    ON CONFLICT(state) DO UPDATE SET n = n + 1;
END;
"""
# `group_counts` is kept by the triggers above in every transaction that moves a group, by
# whatever statement: `count(state)` is one row, where COUNT(*) walked every group in that
# state (the leased ones grow with the fleet, and every lease asked twice). Rebuilt from
# the rows at open, so a database written before the triggers existed counts right too.
_RECOUNT = """
DELETE FROM group_counts;
INSERT INTO group_counts(state, n) SELECT state, COUNT(*) FROM groups GROUP BY state;
"""


_UNREAD = object()
_KV_CACHE_MAX = 10_000


class _Uncached(dict):
    """A kv cache that keeps nothing (`read_view`)."""

    def __setitem__(self, key, value) -> None:
        pass


class ControllerDB(LeaseRows):
    """Named queries and updates on the tables; the caller serializes access (one lock).
    The lease statements and the in-memory lease deadlines: db_leases.py."""

    def __init__(self, path: str):
        self.path = path
        # isolation_level=None: we open transactions ourselves with BEGIN IMMEDIATE.
        self.conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")  # durability: sync() (group commit)
        self.conn.execute("PRAGMA wal_autocheckpoint=0")  # off the lock: Checkpointer
        self.conn.executescript(_SCHEMA)
        audit_cols = {r[1] for r in self.conn.execute("PRAGMA table_info(audit)")}
        for col in ("dev", "var", "cusum"):  # the sampling check's, new in an older database
            if col not in audit_cols:
                self.conn.execute(f"ALTER TABLE audit ADD COLUMN {col} REAL NOT NULL DEFAULT 0")
        episode_cols = {r[1] for r in self.conn.execute("PRAGMA table_info(episodes)")}
        if "drawn" not in episode_cols:  # what a nondeterministic environment drew: newer
            self.conn.execute("ALTER TABLE episodes ADD COLUMN drawn TEXT NOT NULL DEFAULT '[]'")
        self.conn.executescript(f"BEGIN IMMEDIATE; {_RECOUNT} COMMIT;")
        self._kv: dict[str, str | None] = {}  # key -> JSON text (None: no row); see get()
        self._fresh_from: int | None = None  # see stale_buffered
        self.group_commit = GroupCommit(path + "-wal")
        self.checkpointer = Checkpointer(path)
        self._readers = threading.local()
        self._reader_list: list[sqlite3.Connection] = []  # closed with the store
        self._reader_list_lock = threading.Lock()
        self.deadlines = LeaseDeadlines()  # in memory, persisted with the hot state
        self.restore_deadlines(float("-inf"))

    def close(self) -> None:
        self.checkpointer.close()
        self.group_commit.close()
        with self._reader_list_lock:
            for conn in self._reader_list:
                conn.close()
            self._reader_list.clear()
        self.conn.close()

    @contextlib.contextmanager
    def tx(self):
        if self.conn.in_transaction:  # nested: the outer transaction owns commit/rollback
            yield
            return
        self.conn.execute("BEGIN IMMEDIATE")
        self.deadlines.begin()  # its changes are undone with the transaction's
        try:
            yield
        except BaseException:
            self._kv.clear()  # it may hold this transaction's puts
            self._fresh_from = None
            self.conn.execute("ROLLBACK")
            self.deadlines.rollback()
            raise
        try:
            self.conn.execute("COMMIT")
        except BaseException:
            self._kv.clear()
            raise
        self.deadlines.commit()
        self.group_commit.committed()

    def sync(self) -> None:
        """Block until every transaction committed so far is on disk (one fsync for all
        the callers that arrive meanwhile). Call outside the controller's lock."""
        self.group_commit.wait(self.group_commit.last_commit())

    def reader(self) -> sqlite3.Connection:
        """This thread's read-only connection: committed state, no lock, no transaction."""
        conn = getattr(self._readers, "conn", None)
        if conn is None:
            conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False)
            conn.row_factory = sqlite3.Row
            self._readers.conn = conn
            with self._reader_list_lock:
                self._reader_list.append(conn)
        return conn

    def read_view(self) -> ControllerDB:
        """These named reads on this thread's read-only connection: committed state, no
        lock, no transaction, no kv cache (it may hold an open transaction's puts). For a
        check that the locked operation after it repeats (a submission's, intake.py)."""
        view = copy.copy(self)
        view.conn, view._kv = self.reader(), _Uncached()
        return view

    def pinned_view(self) -> ControllerDB:
        """Named reads held to the state committed now (a read transaction on a connection
        of its own: a WAL reader keeps its snapshot), for reads made after the lock is
        released: call under it, `unpin` when done."""
        view = copy.copy(self)
        view.conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, check_same_thread=False)
        view.conn.row_factory, view._kv = sqlite3.Row, _Uncached()
        view.conn.execute("BEGIN")
        view.conn.execute("SELECT COUNT(*) FROM kv").fetchall()  # the snapshot starts here
        return view

    @staticmethod
    def unpin(view: ControllerDB) -> None:
        view.conn.close()

    def q(self, sql: str, args: tuple | list = ()) -> list[sqlite3.Row]:
        """Rows of one read query. The controller uses the named methods below; tests use
        this to audit the tables (under the controller's lock when it is serving)."""
        return self.conn.execute(sql, args).fetchall()

    def _x(self, sql: str, args: tuple | list = ()) -> int:
        return self.conn.execute(sql, args).rowcount

    # -- key/value: counters, cursor, announcement ---------------------------------------
    # Read through a cache of the JSON text (a fresh object per get, as from the table):
    # this connection is the table's only writer, so the cache is the committed value plus
    # this transaction's puts, and a rollback drops it. A lease grant read `next_step` four
    # times and `leases/issued` once, each a statement that released and re-took the GIL
    # under the controller's lock (docs/design/lease-path.md).
    def get(self, key: str, default: Any = None) -> Any:
        text = self._kv.get(key, _UNREAD)
        if text is _UNREAD:
            rows = self.q("SELECT value FROM kv WHERE key=?", (key,))
            text = rows[0]["value"] if rows else None
            self._remember(key, text)
        return default if text is None else json.loads(text)

    def put(self, key: str, value: Any) -> None:
        text = json.dumps(value)
        if self._kv.get(key, _UNREAD) == text:  # the row holds it already: no statement
            return
        self._x("INSERT OR REPLACE INTO kv(key, value) VALUES (?, ?)", (key, text))
        self._remember(key, text)

    def _remember(self, key: str, text: str | None) -> None:
        if len(self._kv) >= _KV_CACHE_MAX:  # per-lease keys grow with the run: bounded
            self._kv.clear()
        self._kv[key] = text

    def incr(self, key: str, n: float = 1) -> None:
        if n:  # adding 0 changes nothing a reader sees (absent reads as 0): no statement
            self.put(key, self.get(key, 0) + n)

    # -- groups --------------------------------------------------------------------------
    def add_groups(self, prompts: list[tuple[str, str, str]]) -> None:
        """Queue new prompt groups, each (prompt_id, prompt, answer)."""
        self.conn.executemany(
            "INSERT INTO groups(prompt_id, prompt, answer, state) VALUES (?, ?, ?, 'queued')",
            prompts,
        )

    def count(self, *states: str) -> int:
        """Groups in any of `states`: rows of `group_counts` (kept by triggers), not a scan."""
        marks = ", ".join("?" * len(states))
        sql = f"SELECT COALESCE(SUM(n), 0) AS n FROM group_counts WHERE state IN ({marks})"
        return self.q(sql, states)[0]["n"]

    def groups_in(self, state: str, limit: int = -1) -> list[sqlite3.Row]:
        """Groups in `state`, queue order (oldest row first); limit -1: all."""
        return self.q(
            "SELECT * FROM groups WHERE state=? ORDER BY group_id LIMIT ?", (state, limit)
        )

    def queued_not_dropped_by(self, worker_id: str, limit: int) -> list[sqlite3.Row]:
        """Queued groups in queue order, except those a lease of `worker_id` returned too
        stale (table `dropped`): a dropped group requeues at the front, and the worker that
        was too slow for it would otherwise take it again at once, and again (leasing.py)."""
        return self.q(
            "SELECT * FROM groups g WHERE g.state='queued' AND NOT EXISTS (SELECT 1 FROM"
            " dropped d WHERE d.group_id=g.group_id AND d.worker_id=?)"
            " ORDER BY g.group_id LIMIT ?",
            (worker_id, limit),
        )

    def groups_of_lease(self, lease_id: str) -> list[sqlite3.Row]:
        return self.q("SELECT * FROM groups WHERE lease_id=? ORDER BY group_id", (lease_id,))

    def groups_held(self, worker_id: str) -> int:
        """How many groups `worker_id` holds leased (not yet submitted). From the worker's
        active leases (index `leases_worker`) to their groups: O(what it holds). A leased
        group's lease is active (every end of a lease requeues its leased groups first);
        joined the other way SQLite walked every leased group of the fleet."""
        return self.q(
            "SELECT COUNT(*) AS n FROM leases l CROSS JOIN groups g ON g.lease_id=l.lease_id"
            " WHERE l.worker_id=? AND l.state='active' AND g.state='leased'",
            (worker_id,),
        )[0]["n"]

    def set_state(self, group_ids: list[int], state: str, **cols: Any) -> None:
        if state == "buffered":
            self._fresh_from = None
        sets = ", ".join(["state=?"] + [f"{k}=?" for k in cols])
        self.conn.executemany(
            f"UPDATE groups SET {sets} WHERE group_id=?",
            [(state, *cols.values(), g) for g in group_ids],
        )

    def buffer_group(
        self, group_id: int, trajectories: list[dict] | str, min_version: int, now: float
    ) -> None:
        """Accept a group's trajectories (JSON in `payload`, or already JSON text): it
        waits for the learner."""
        payload = trajectories if isinstance(trajectories, str) else json.dumps(trajectories)
        if self._fresh_from is not None:
            self._fresh_from = min(self._fresh_from, min_version)
        self._x(
            "UPDATE groups SET state='buffered', payload=?, min_version=?, accepted_at=?"
            " WHERE group_id=?",
            (payload, min_version, now, group_id),
        )

    def oldest_buffered(self, limit: int) -> list[sqlite3.Row]:
        """Buffered groups in batch order: oldest version first, then earliest arrival."""
        return self.q(
            "SELECT * FROM groups WHERE state='buffered'"
            " ORDER BY min_version, accepted_at, group_id LIMIT ?",
            (limit,),
        )

    def stale_buffered(self, oldest_fresh: int) -> list[int]:
        """Buffered groups whose stalest trajectory is older than `oldest_fresh`
        (bridge/contracts/staleness.py: `oldest_fresh(step, S)`), which the caller requeues.
        Every lease asks, and the answer changes only when the learner's step moves or a
        stale group is buffered: no query while every buffered group is known fresh
        (`_fresh_from`: no buffered group is older; None: unknown)."""
        if self._fresh_from is not None and oldest_fresh <= self._fresh_from:
            return []
        rows = self.q(
            "SELECT group_id FROM groups WHERE state='buffered' AND min_version < ?",
            (oldest_fresh,),
        )
        self._fresh_from = oldest_fresh
        return [r["group_id"] for r in rows]

    def oldest_buffered_version(self) -> int | None:
        """The oldest version any buffered group holds (None: the buffer is empty)."""
        return self.q("SELECT MIN(min_version) AS v FROM groups WHERE state='buffered'")[0]["v"]

    def buffered_of_worker(self, worker_id: str) -> list[int]:
        """Buffered (accepted, not yet consumed) groups that `worker_id` generated."""
        rows = self.q(
            "SELECT g.group_id FROM groups g JOIN leases l ON g.lease_id=l.lease_id"
            " WHERE l.worker_id=? AND g.state='buffered'",
            (worker_id,),
        )
        return [r["group_id"] for r in rows]

    def buffered_newer_than(self, version: int) -> list[int]:
        """Buffered groups with a trajectory token sampled by a version newer than `version`."""
        rows = self.q("SELECT group_id, payload FROM groups WHERE state='buffered'")
        return [
            r["group_id"]
            for r in rows
            if any(max(t["versions"]) > version for t in json.loads(r["payload"]))
        ]

    def record_dropped(self, group_ids: list[int], step: int) -> None:
        """Keep what each buffered group in `group_ids` was -- prompt, stalest version, the
        worker, each completion's token count and reward -- before `requeue` clears it: what
        the staleness bound throws away is otherwise invisible (bench/staleness_bias.py
        compares it with what the learner consumed). A summary, not the payload: a few
        numbers per group, in SQL, so no trajectory is decoded under the lock."""
        self.conn.executemany(
            "INSERT INTO dropped(group_id, prompt_id, step, min_version, worker_id, lengths,"
            " rewards) SELECT g.group_id, g.prompt_id, ?, g.min_version,"
            " (SELECT l.worker_id FROM leases l WHERE l.lease_id=g.lease_id),"
            " (SELECT json_group_array(json_array_length(t.value, '$.completion_token_ids'))"
            "  FROM json_each(g.payload) t),"
            " (SELECT json_group_array(json_extract(t.value, '$.reward'))"
            "  FROM json_each(g.payload) t)"
            " FROM groups g WHERE g.group_id=? AND g.state='buffered'",
            [(step, g) for g in group_ids],
        )

    def dropped_groups(self) -> list[sqlite3.Row]:
        """Every group the staleness bound dropped, in drop order (`record_dropped`)."""
        return self.q("SELECT * FROM dropped ORDER BY rowid")

    def requeue(self, group_ids: list[int]) -> None:
        """Back to the queue (the same row, so it goes out before newer prompts)."""
        self.conn.executemany(
            "UPDATE groups SET state='queued', lease_id=NULL, payload=NULL, min_version=NULL,"
            " accepted_at=NULL, consumed_step=NULL, attempts=attempts+1 WHERE group_id=?",
            [(g,) for g in group_ids],
        )

    def revert_consumed_after(self, step: int) -> int:
        """Groups consumed after learner step `step` go back to the buffer; returns how many."""
        self._fresh_from = None
        return self._x(
            "UPDATE groups SET state='buffered', consumed_step=NULL"
            " WHERE state='consumed' AND consumed_step>? AND payload IS NOT NULL",
            (step,),
        )

    def forget_consumed(self, up_to_step: int) -> int:
        """Delete groups consumed at or before `up_to_step`; returns how many."""
        return self._x(
            "DELETE FROM groups WHERE state='consumed' AND consumed_step<=?", (up_to_step,)
        )

    # -- workers -------------------------------------------------------------------------
    def add_worker(self, worker_id: str, token_hash: str, profile_json: str, now: float) -> None:
        self._x(
            "INSERT INTO workers(worker_id, token_hash, profile, registered_at, last_seen)"
            " VALUES (?, ?, ?, ?, ?)",
            (worker_id, token_hash, profile_json, now, now),
        )

    def worker(self, worker_id: str) -> sqlite3.Row | None:
        rows = self.q("SELECT * FROM workers WHERE worker_id=?", (worker_id,))
        return rows[0] if rows else None

    def engine_dtypes(self, worker_ids) -> dict[str, str]:
        """worker_id -> the engine dtype its registered profile declares ("bfloat16" when it
        declares none) of those of `worker_ids` that exist, in one statement."""
        rows = self.q(
            "SELECT worker_id, json_extract(profile, '$.engine_dtype') AS dtype FROM workers"
            " WHERE worker_id IN (SELECT value FROM json_each(?))",
            (json.dumps(sorted(worker_ids)),),
        )
        return {r["worker_id"]: str(r["dtype"] or "bfloat16") for r in rows}

    def workers(self) -> list[sqlite3.Row]:
        """Every worker ever registered, including those that left."""
        return self.q("SELECT * FROM workers")

    def update_worker(self, worker_id: str, **cols: Any) -> None:
        sets = ", ".join(f"{k}=?" for k in cols)
        self._x(f"UPDATE workers SET {sets} WHERE worker_id=?", (*cols.values(), worker_id))

    # -- fleet plan (bridge/control/fleet/fleet_plan.py) ---------------------------------------
    # Its own table, not columns of `workers`: CREATE IF NOT EXISTS upgrades an older
    # database without a migration.
    def fleet_rows(self) -> dict[str, sqlite3.Row]:
        """worker_id -> (standby, changed_at, standby_s, rollouts_per_s) of measured or
        planned workers."""
        return {r["worker_id"]: r for r in self.q("SELECT * FROM fleet")}

    def fleet_row(self, worker_id: str) -> sqlite3.Row | None:
        rows = self.q("SELECT * FROM fleet WHERE worker_id=?", (worker_id,))
        return rows[0] if rows else None

    def set_standby(self, worker_id: str, standby: bool, now: float) -> None:
        self._x(
            "INSERT INTO fleet(worker_id, standby, changed_at) VALUES (?, ?, ?)"
            " ON CONFLICT(worker_id) DO UPDATE SET standby=excluded.standby,"
            " changed_at=excluded.changed_at",
            (worker_id, int(standby), now),
        )

    def add_standby_s(self, worker_id: str, seconds: float) -> None:
        self._x("UPDATE fleet SET standby_s=standby_s+? WHERE worker_id=?", (seconds, worker_id))

    def set_rollout_rate(self, worker_id: str, rollouts_per_s: float) -> None:
        """The controller's measurement of `worker_id`'s throughput."""
        self._x(
            "INSERT INTO fleet(worker_id, rollouts_per_s) VALUES (?, ?)"
            " ON CONFLICT(worker_id) DO UPDATE SET rollouts_per_s=excluded.rollouts_per_s",
            (worker_id, rollouts_per_s),
        )

    # -- behaviour audit and quarantine (bridge/control/trust/audit.py) ------------------------
    # In the database, not in memory: a controller restart must neither forget a worker's
    # evidence nor let a quarantined worker back in.
    def audit_sums(self, worker_id: str) -> dict[str, float] | None:
        """The token-decayed sums {k3, lr, n, total, dev, var, cusum} of `worker_id`, None
        before any (dev, var, cusum: the sampling check's, audit.py)."""
        rows = self.q(
            "SELECT k3, lr, n, total, dev, var, cusum FROM audit WHERE worker_id=?", (worker_id,)
        )
        return dict(rows[0]) if rows else None

    def put_audit_sums(self, worker_id: str, sums: dict[str, float]) -> None:
        self._x(
            "INSERT OR REPLACE INTO audit(worker_id, k3, lr, n, total, dev, var, cusum)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (worker_id, *(sums[k] for k in ("k3", "lr", "n", "total", "dev", "var", "cusum"))),
        )

    def quarantine_worker(self, worker_id: str, at: float, why: str, dropped: int) -> None:
        """Record the quarantine and revoke the token: a revoked token hashes to nothing, so
        authentication fails (401) from now on; the worker counts as left and disabled."""
        self._x(
            "INSERT OR REPLACE INTO quarantine(worker_id, at, why, dropped_groups)"
            " VALUES (?, ?, ?, ?)",
            (worker_id, at, why, dropped),
        )
        self.update_worker(worker_id, token_hash=f"quarantined:{worker_id}", enabled=0, left_at=at)

    def quarantined(self) -> dict[str, sqlite3.Row]:
        """worker_id -> (at, why, dropped_groups) of every quarantined worker."""
        return {r["worker_id"]: r for r in self.q("SELECT * FROM quarantine")}
