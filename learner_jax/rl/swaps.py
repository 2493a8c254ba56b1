"""When each worker first serves each published version: `<workdir>/swaps.jsonl`.

    watcher = SwapWatcher(ctl, path)      # polls ctl.worker_versions() on a thread
    watcher.published(announcement)       # the publisher tells it each version's time
    watcher.stop()

Workers report their version on every lease request and heartbeat, so the time from a
publish to a worker's swap is observable at the controller, to within a lease poll. One
line per (worker, version) change: worker_id, price_per_hour, version, seen_at,
published_at. Versions published before a worker registered are skipped (that is the
worker's startup time, not a swap).
"""

from __future__ import annotations

import json
import threading

SWAPS_FILE = "swaps.jsonl"


class SwapWatcher:
    def __init__(self, ctl, path: str, period_s: float = 0.2):
        self.ctl, self.path, self.period_s = ctl, path, period_s
        self.published_at: dict[int, float] = {}  # version -> announce time (ctl clock)
        self._seen: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="swap-watcher")
        self._thread.start()

    def published(self, announcement) -> None:
        self.published_at[announcement.version] = announcement.published_at

    def _loop(self) -> None:
        with open(self.path, "a") as f:
            while not self._stop.wait(self.period_s):
                now = self.ctl.clock()
                for line in self.poll(now):
                    f.write(json.dumps(line) + "\n")
                f.flush()

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
