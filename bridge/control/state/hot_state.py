"""Hot state: what every heartbeat changes lives in memory, not in SQLite (issue 25).

At fleet scale most requests are heartbeats, and each one changed rows: the worker's last
contact, billed seconds, reported version and gauges, and its leases' deadlines. None of
that needs to survive a crash exactly (a heartbeat is not acknowledged work), so it is kept
here and in the lease deadline table (bridge/control/state/db_leases.py) and written to the
database in batches:

- at most `hot_flush_s` apart, by `HotFlusher` (a thread of the controller; the same pass
  ends expired leases, so their groups requeue while nobody else calls);
- before anything reads those columns as a table (stats, status, run end, the active-set
  solve: `Controller._persist_hot`), so readers see what the memory says;
- at `Controller.close()`.

What matters is durable at once and not here: a lease's grant and its end, acceptances,
registrations, leaves, quarantines (rows in the operation's transaction, synced before the
reply). A heartbeat takes no controller lock and touches no SQLite: `HotWorkers.touch`, the
deadline renewal and the cached announcement/run end/standby set are all in memory; only
when the activation solve is due (at most every `activation_period_s`, activation on) does
the heartbeat that finds it due run it (`Controller.heartbeat`).

Authentication is in memory too: `HotWorkers` maps each live worker's token hash to its id
(loaded from the table at start, updated by register/leave/quarantine), so an unknown token
costs no database read either.

After a kill -9 the controller rebuilds all of this from the database (the last persisted
values, at most `hot_flush_s` old) and the workers' next heartbeats; lease deadlines are
restored conservatively (db_leases.py). Billing loses at most the last flush interval.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from collections.abc import Callable

_HOT = ("last_seen", "active_s", "version", "samples_per_s", "tokens_per_s")


@dataclasses.dataclass
class HotWorker:
    token_hash: str
    last_seen: float
    active_s: float
    version: int
    samples_per_s: float
    tokens_per_s: float
    enabled: bool


class HotWorkers:
    """Every live (registered, not left, not quarantined) worker's hot columns."""

    def __init__(self):
        self._lock = threading.Lock()
        self._w: dict[str, HotWorker] = {}
        self._tokens: dict[str, str] = {}  # token hash -> worker id
        self._dirty: set[str] = set()
        self._swaps: list[tuple[str, int, float]] = []  # (worker, new version, seen at)

    def load(self, rows) -> None:
        """Replace everything by the database's `workers` rows (those not left)."""
        with self._lock:
            self._w.clear(), self._tokens.clear(), self._dirty.clear()
            for r in rows:
                if r["left_at"] is None:
                    self._w[r["worker_id"]] = HotWorker(
                        r["token_hash"], *(r[k] for k in _HOT), bool(r["enabled"])
                    )
                    self._tokens[r["token_hash"]] = r["worker_id"]

    def add(self, worker_id: str, token_hash: str, now: float) -> None:
        with self._lock:
            self._w[worker_id] = HotWorker(token_hash, now, 0.0, -1, 0.0, 0.0, True)
            self._tokens[token_hash] = worker_id

    def drop(self, worker_id: str) -> None:
        """`worker_id` left or was quarantined: its token no longer authenticates."""
        with self._lock:
            w = self._w.pop(worker_id, None)
            if w is not None:
                self._tokens.pop(w.token_hash, None)
            self._dirty.discard(worker_id)

    def by_token(self, token_hash: str) -> tuple[str, float] | None:
        """(worker_id, last_seen) of the live worker holding the token, None if none."""
        with self._lock:
            worker_id = self._tokens.get(token_hash)
            return None if worker_id is None else (worker_id, self._w[worker_id].last_seen)

    def get(self, worker_id: str) -> HotWorker | None:
        with self._lock:
            w = self._w.get(worker_id)
            return None if w is None else dataclasses.replace(w)

    def set_enabled(self, worker_id: str, enabled: bool) -> None:
        with self._lock:
            if worker_id in self._w:
                self._w[worker_id].enabled = enabled

    def touch(self, worker_id: str, now: float, timeout_s: float, version=None, **gauges):
        """A contact at `now`: returns the billed gap (last contact, now), None when the gap
        is longer than `timeout_s` (not billed) or the worker is unknown. A version above
        the one on record is queued for `take_swaps`."""
        with self._lock:
            w = self._w.get(worker_id)
            if w is None:
                return None
            gap = now - w.last_seen
            billed = (w.last_seen, now) if 0 < gap <= timeout_s else None
            if billed:
                w.active_s += gap
            w.last_seen = max(w.last_seen, now)
            if version is not None:
                if version > w.version:
                    self._swaps.append((worker_id, version, now))
                w.version = version
            for k, v in gauges.items():
                setattr(w, k, v)
            self._dirty.add(worker_id)
            return billed

    def live_versions(self, since: float) -> dict[str, int]:
        """worker id -> reported version of every worker heard at or after `since`."""
        with self._lock:
            return {k: w.version for k, w in self._w.items() if w.last_seen >= since}

    def take_swaps(self) -> list[tuple[str, int, float]]:
        with self._lock:
            out, self._swaps = self._swaps, []
            return out

    def take_dirty(self, only: str | None = None) -> list[tuple]:
        """(last_seen, active_s, version, samples_per_s, tokens_per_s, worker_id) of every
        worker changed since the last call (or of `only`, if changed)."""
        with self._lock:
            ids = self._dirty if only is None else self._dirty & {only}
            out = [(*(getattr(self._w[w], k) for k in _HOT), w) for w in ids if w in self._w]
            self._dirty -= set(ids)
            return out


class HotFlusher:
    """Calls `flush` (a bound method) every `every_s` seconds (wall clock) on a daemon
    thread until `stop`, or until its object is garbage (held weakly: a controller nobody
    closed does not live on in its flusher)."""

    def __init__(self, flush: Callable[[], None], every_s: float):
        self._flush, self._every_s = weakref.WeakMethod(flush), every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hot-flush", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            flush = self._flush()
            if flush is None:
                return
            try:
                flush()
            except Exception:  # a closed store at shutdown, a locked disk: try again
                if not self._stop.is_set():
                    logging.exception("controller: persisting the hot state failed")
            del flush

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
