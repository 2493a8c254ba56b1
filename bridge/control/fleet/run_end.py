"""The end of a run, as the workers hear it.

`end()` (the learner, via `Controller.end_run`, before it stops the server) records the run
end in the controller's database; from then on every heartbeat answers `run_over=true` and
every lease `reason="run_over"` (`tell`), so polling workers leave and exit 0 instead of
retrying a vanished controller. The server keeps answering until `all_told` says every live
worker heard it (the drain in `Controller.wait_run_over_seen`). A controller that starts
serves a live run, so a resumed run clears an old end (`clear`).

Part of `Controller` (bridge/control/controller.py): callers hold its lock and transaction.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from bridge.control.config import ControllerConfig
from bridge.control.fleet import fleet_status
from bridge.control.state.db import ControllerDB


class RunEnd:
    def __init__(self, db: ControllerDB, config: ControllerConfig, clock: Callable[[], float]):
        self.db, self.config, self.clock = db, config, clock
        self._told: set[str] = set()  # workers answered run_over since the end
        self._over = db.get("run_over") is not None  # in memory: every heartbeat asks

    def clear(self) -> None:
        if self.db.get("run_over") is not None:
            self.db.put("run_over", None)
        self._over = False

    def end(self, reason: str) -> None:
        if self.db.get("run_over") is None:
            self.db.put("run_over", {"at": self.clock(), "reason": reason})
            logging.info("run over (%s): telling the workers to leave", reason)
        self._over = True

    def tell(self, worker_id: str) -> bool:
        """Whether the run is over; remembers that `worker_id` was told. No SQLite."""
        if not self._over:
            return False
        self._told.add(worker_id)
        return True

    def all_told(self) -> bool:
        """Every live worker (not left, not quarantined, heard from within three heartbeat
        intervals) was told. A worker silent for three heartbeats is dead or cut off:
        waiting for it to poll would only hold the learner's exit up."""
        c, now = self.config, self.clock()
        timeout_s = min(c.worker_timeout_s, 3 * c.heartbeat_interval_s + 1)
        return all(
            w["worker_id"] in self._told
            for w in self.db.workers()
            if fleet_status.worker_state(w, now, timeout_s) not in ("gone", "quarantined")
        )


def wait_all_told(all_told: Callable[[], bool], timeout_s: float) -> bool:
    """Poll `all_told` until true or `timeout_s` passes (wall clock)."""
    deadline = time.monotonic() + timeout_s
    while not all_told():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True
