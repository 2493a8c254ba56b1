"""The heartbeat interval the controller hands out: load grows with work, not idle workers.

Every heartbeat reply carries the next interval: `heartbeat_interval_s` for a small fleet,
else the live fleet (workers heard within `worker_timeout_s`) divided by
`heartbeat_budget_per_s` (config.py), capped at `worker_timeout_s / 3` so a worker that
misses one beat is still not declared dead. Recounted at most once a second.
"""

from __future__ import annotations

import threading

from bridge.control.config import ControllerConfig


class HeartbeatPacing:
    def __init__(self, config: ControllerConfig):
        self.config = config
        self._lock = threading.Lock()
        self._heard: dict[str, float] = {}  # worker -> last heartbeat
        self._interval = (float("-inf"), config.heartbeat_interval_s)  # (computed at, s)

    def interval(self, now: float, worker_id: str | None = None) -> float:
        c = self.config
        with self._lock:
            if worker_id is not None:
                self._heard[worker_id] = now
            at, interval = self._interval
            if now - at >= 1.0 and c.heartbeat_budget_per_s > 0:
                cutoff = now - c.worker_timeout_s
                self._heard = {w: t for w, t in self._heard.items() if t >= cutoff}
                fleet = len(self._heard) / c.heartbeat_budget_per_s
                interval = max(c.heartbeat_interval_s, min(fleet, c.worker_timeout_s / 3))
                self._interval = (now, interval)
            return interval
