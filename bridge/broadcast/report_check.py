"""Answering a corrupt-chunk report by re-verifying the accused chunk (issue 23 item 2).

A worker that says "relay R served me a corrupt chunk K of version v" is making a claim;
chunks carry a cryptographic digest in the manifest (bridge/broadcast/chunks.py), so the
controller can check it instead of counting accusers: it reads the manifest from the store
(the root of trust, never from a peer), asks R for K itself (`GET {R}/kv/{K}`, what a
child asks), and compares the digest.

    verdict = check_chunk(store_spec, relay_url, version, key)   # one of VERDICTS

- `corrupt`: R serves bytes that are not chunk K: proof, R relays no more.
- `ok`: R serves K intact; `no_chunk`: K is no chunk of version v. Either way the report
  was false: it costs the reporter (bridge/broadcast/state.py), never the relay.
- `unknown`: R did not answer (gone, busy, version evicted) or the store no longer has v:
  nothing is proven either way.

A relay that corrupts bytes only for some clients and serves the controller correctly is
not caught here; its children lose nothing but time (they verify every chunk and fall back
to the next source, then the store), and its measured delivery (topology.rank_rate) drops,
so it loses its place in the tree.

`probe_uplink` is the controller measuring a relay itself (bridge/broadcast/state.py probes
a relay no child has measured yet): one chunk, timed and verified.

`ReportChecker` runs checks (or probes) on one background thread so a heartbeat never waits
on a relay; at most `max_pending` checks wait (more are answered `unknown` at once).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import httpx

from bridge.broadcast import chunks as chunks_lib

VERDICTS = ("corrupt", "ok", "no_chunk", "unknown")
TIMEOUT_S = 10.0  # per check: connect + the whole chunk


def check_chunk(store_spec, relay_url: str, version: int, key: str,
                timeout_s: float = TIMEOUT_S) -> str:  # fmt: skip
    """The verdict on "`relay_url` served a corrupt `key` of `version`" (module docstring).
    The manifest is read for every check (reports are rare; a version number re-published
    after a rollback must not be judged by its old digests)."""
    from bridge.store.weight_store import WeightStore

    try:
        manifest = WeightStore(store_spec).manifest(version)  # the root of trust
        plan = {s.key: s for s in chunks_lib.chunk_plan(version, manifest)}
    except Exception as e:  # noqa: BLE001 - gc'd, a delta version, the store unreachable
        logging.info("corrupt-chunk report on version %d not checkable: %s", version, e)
        return "unknown"
    spec = plan.get(key)
    if spec is None:
        return "no_chunk"
    limit = spec.full_nbytes + 1  # a relay cannot make the controller read more than this
    try:
        with httpx.stream("GET", f"{relay_url}/kv/{key}", params={"wait": 0},
                          timeout=timeout_s) as r:  # fmt: skip
            if r.status_code == 404:
                raw = None  # absent = all fill value, as a child reads it
            elif r.status_code != 200:
                return "unknown"
            else:
                body = bytearray()
                for piece in r.iter_bytes():
                    body += piece
                    if len(body) > limit:
                        return "corrupt"  # longer than the chunk: not chunk `key`
                raw = bytes(body)
    except httpx.HTTPError:
        return "unknown"
    return "ok" if chunks_lib.chunk_ok(spec, raw) else "corrupt"


def probe_uplink(store_spec, relay_url: str, version: int, key: str = "",
                 timeout_s: float = TIMEOUT_S) -> tuple[str, float | None, int]:  # fmt: skip
    """The controller's own measurement of a relay: (verdict, bytes/s, bytes) of reading the
    largest chunk of `version` from `relay_url` as a child would, checked against the
    store's manifest. `key` is unused (the probe picks the chunk; ReportChecker passes one).

    `ok`: it served the chunk intact at that rate; `corrupt`: it served other bytes (proof,
    as for a report); `unknown`: no answer, busy, the version gone, or nothing to time (the
    chunk is absent, all fill value): nothing measured, the relay stays a leaf."""
    del key
    from bridge.store.weight_store import WeightStore

    try:
        plan = chunks_lib.chunk_plan(version, WeightStore(store_spec).manifest(version))
    except Exception as e:  # noqa: BLE001 - gc'd, the store unreachable
        logging.info("uplink probe of version %d not possible: %s", version, e)
        return "unknown", None, 0
    if not plan:
        return "unknown", None, 0
    spec = max(plan, key=lambda s: s.full_nbytes)
    t0, body = time.monotonic(), bytearray()
    try:
        with httpx.stream("GET", f"{relay_url}/kv/{spec.key}", params={"wait": 0},
                          timeout=timeout_s) as r:  # fmt: skip
            if r.status_code != 200:
                return "unknown", None, 0  # absent (nothing to time), busy, not held
            for piece in r.iter_bytes():
                body += piece
                if len(body) > spec.full_nbytes:
                    return "corrupt", 0.0, 0
    except httpx.HTTPError:
        return "unknown", None, 0
    seconds = max(time.monotonic() - t0, 1e-6)
    if not chunks_lib.chunk_ok(spec, bytes(body)):
        return "corrupt", 0.0, 0
    return "ok", len(body) / seconds, len(body)


class ReportChecker:
    """`submit(store, url, version, key, done)`: `done(verdict)` runs later on the
    checker's own thread (daemon)."""

    def __init__(self, check: Callable[..., str] = check_chunk, max_pending: int = 32):
        self.check, self.jobs = check, queue.Queue(maxsize=max_pending)
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def submit(self, store, url: str, version: int, key: str, done) -> bool:
        """Queue a check; False (and `done` never called) when `max_pending` are waiting."""
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="report-check")  # fmt: skip
                self._thread.start()
        try:
            self.jobs.put_nowait((store, url, version, key, done))
        except queue.Full:
            return False
        return True

    def _run(self) -> None:
        while True:
            store, url, version, key, done = self.jobs.get()
            try:
                verdict = self.check(store, url, version, key)
            except Exception as e:  # noqa: BLE001 - never kill the checker
                logging.warning("corrupt-chunk report check failed: %s", e)
                verdict = "unknown"
            try:
                done(verdict)
            except Exception:  # noqa: BLE001
                logging.exception("applying a corrupt-chunk verdict failed")
