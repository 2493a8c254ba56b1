"""Group commit for the controller's SQLite store (bridge/control/state/db.py), issue 25.

The store runs `synchronous=NORMAL` in WAL mode: a COMMIT writes its frames to the WAL
and returns without an fsync. What the controller acknowledges must still be on disk
before the reply (a lease grant, an acceptance, a registration), so after its transaction
the operation calls `ControllerDB.sync()`, outside the controller's lock. Here the first
caller fsyncs the WAL for every commit made so far; callers that arrive meanwhile wait
for that fsync, or lead the next one, which covers all of them: N submissions within an
fsync's time cost one fsync, not N, and nobody holds the lock while the disk works.

Why an fsync of the WAL is enough: every committed transaction is in the WAL file (page
cache) when its COMMIT returns; fsync flushes all of the file's dirty pages, so after it
returns every transaction committed before it started is durable. A checkpoint (which
copies WAL frames into the database file and later rewinds the WAL) syncs the database
file itself, so frames the WAL no longer holds are durable there; it runs on a connection
and thread of its own (`Checkpointer`), never inside a COMMIT under the controller's lock.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
import time


class GroupCommit:
    """Leader/follower group commit over the WAL file: `committed()` after each COMMIT
    (under the writer's lock) numbers it; `wait(n)` returns once commit n is on disk. The
    first waiter fsyncs everything committed so far; waiters that arrive while it does
    wait for that fsync, or lead the next one, which covers them all."""

    def __init__(self, wal_path: str):
        self.wal_path = wal_path
        self._cond = threading.Condition()
        self._committed = self._synced = 0
        self._flushing = False
        self._fd: int | None = None
        self.fsyncs = 0  # how many fsyncs covered how many commits: the batching factor
        self.fsync_s = self.fsync_max_s = 0.0  # time on the disk, in all and the longest
        self._local = threading.local()

    def stats(self) -> dict:
        return {
            "commits": self._committed,
            "fsyncs": self.fsyncs,
            "fsync_mean_ms": 1e3 * self.fsync_s / max(1, self.fsyncs),
            "fsync_max_ms": 1e3 * self.fsync_max_s,
        }

    def committed(self) -> None:
        with self._cond:
            self._committed += 1
            self._local.last = self._committed

    def last_commit(self) -> int:
        """The number of this thread's last commit (0: none)."""
        return getattr(self._local, "last", 0)

    def wait(self, n: int) -> None:
        with self._cond:
            while self._synced < n:
                if self._flushing:
                    self._cond.wait()
                    continue
                self._flushing, target = True, self._committed
                self._cond.release()
                t0 = time.perf_counter()
                try:
                    self._fsync()
                finally:
                    took = time.perf_counter() - t0
                    self.fsync_s, self.fsync_max_s = (
                        self.fsync_s + took,
                        max(self.fsync_max_s, took),
                    )
                    self._cond.acquire()
                    self._flushing = False
                    self._cond.notify_all()
                self._synced = max(self._synced, target)
                self.fsyncs += 1

    def _fsync(self) -> None:
        # The WAL lives as long as the writer's connection (SQLite rewinds it after a
        # checkpoint, and a checkpoint syncs the database file itself); reopen if replaced.
        try:
            st = os.stat(self.wal_path)
        except FileNotFoundError:
            return  # nothing written through the WAL yet
        if self._fd is not None and os.fstat(self._fd).st_ino != st.st_ino:
            os.close(self._fd)
            self._fd = None
        if self._fd is None:
            self._fd = os.open(self.wal_path, os.O_RDONLY)
        os.fsync(self._fd)

    def close(self) -> None:
        with self._cond:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class Checkpointer:
    """Checkpoints the WAL into the database file from a connection and thread of its own
    (PASSIVE, every `period_s`), so that no COMMIT under the controller's lock runs one:
    SQLite's automatic checkpoint (`ControllerDB` turns it off) ran in the committing thread,
    and its fsyncs held the lock up to 0.3 s at 500 workers (issue 25, stop 36).

    Durable as before: the checkpoint syncs the WAL, copies its frames into the database
    file and syncs that before any writer may rewind the WAL (this connection's
    `synchronous` is SQLite's default, FULL). The writer's last close checkpoints the rest."""

    def __init__(self, path: str, period_s: float = 1.0):
        self.period_s = period_s
        self._stop = threading.Event()
        self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._thread = threading.Thread(target=self._run, name="wal-checkpoint", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self._conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
            except sqlite3.Error as e:  # the next period tries again; commits are unaffected
                logging.warning("WAL checkpoint failed (will retry): %s", e)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._conn.close()
