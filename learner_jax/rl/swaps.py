"""When each worker first serves each published version (`<workdir>/swaps.jsonl`) and how
it fetched it (`<workdir>/broadcast.jsonl`).

    watcher = SwapWatcher(ctl, path)      # polls ctl.worker_versions() on a thread
    watcher.published(announcement)       # the publisher tells it each version's time
    watcher.stop()

Workers report their version on every lease request and heartbeat, so the time from a
publish to a worker's swap is observable at the controller, to within a lease poll. One
line per (worker, version) change: worker_id, price_per_hour, version, seen_at,
published_at. Versions published before a worker registered are skipped (that is the
worker's startup time, not a swap).

`broadcast.jsonl`, beside it: one line per (worker, version) fetch the worker reported in
its heartbeats (workers with a relay, bridge/broadcast): worker_id, version, published_at,
done_at (the controller's clock), latency_s, bytes_from_store, bytes_from_peers.
"""

from __future__ import annotations

import json
import os
import threading

SWAPS_FILE = "swaps.jsonl"
BROADCAST_FILE = "broadcast.jsonl"


class SwapWatcher:
    def __init__(self, ctl, path: str, period_s: float = 0.2):
        self.ctl, self.path, self.period_s = ctl, path, period_s
        self.published_at: dict[int, float] = {}  # version -> announce time (ctl clock)
        self._seen: dict[str, int] = {}
        self._fetched: set[tuple[str, int]] = set()
        self.broadcast_path = os.path.join(os.path.dirname(path), BROADCAST_FILE)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="swap-watcher")
        self._thread.start()

    def published(self, announcement) -> None:
        self.published_at[announcement.version] = announcement.published_at

    def _loop(self) -> None:
        with open(self.path, "a") as f, open(self.broadcast_path, "a") as fb:
            while not self._stop.wait(self.period_s):
                now = self.ctl.clock()
                for line in self.poll(now):
                    f.write(json.dumps(line) + "\n")
                for line in self.poll_fetches():
                    fb.write(json.dumps(line) + "\n")
                f.flush()
                fb.flush()

    def poll_fetches(self) -> list[dict]:
        """Lines for the fetches reported since the last poll."""
        out = []
        for r in self.ctl.broadcast_fetches():
            key = (r["worker_id"], r["version"])
            if key not in self._fetched:
                self._fetched.add(key)
                out.append({**r, "latency_s": max(0.0, r["done_at"] - r["published_at"])})
        return out

    def poll(self, now: float) -> list[dict]:
        """Lines for the workers whose version changed since the last poll."""
        out = []
        for w in self.ctl.worker_versions():
            wid, v = w["worker_id"], w["version"]
            if v < 0 or self._seen.get(wid) == v:
                continue
            self._seen[wid] = v
            pub = self.published_at.get(v)
            if pub is None or pub < w["registered_at"]:
                continue
            out.append(
                {
                    "worker_id": wid,
                    "price_per_hour": w["price_per_hour"],
                    "version": v,
                    "seen_at": now,
                    "published_at": pub,
                }
            )
        return out

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
