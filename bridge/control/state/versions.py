"""The published policy version, as the controller announces it to workers.

`VersionBoard` is a part of `Controller` (bridge/control/controller.py) and owns one fact:
the newest announcement (version, weight store, publish time), kept in the database's
key/value table so a restarted controller announces what was published before. It never
references the controller; the caller holds the controller's lock and transaction, except
for `current` and `swap_to`, which read the copy in memory (a heartbeat asks, hot_state.py).
"""

from __future__ import annotations

from collections.abc import Callable

from bridge.control.protocol import VersionAnnouncement
from bridge.control.state.db import ControllerDB


class VersionBoard:
    def __init__(self, db: ControllerDB, clock: Callable[[], float]):
        self.db, self.clock = db, clock
        self.reload()

    def reload(self) -> None:
        """Read the announcement back from the database (a rollback rewrote it)."""
        self._current = VersionAnnouncement(**self.db.get("announcement", {"version": -1}))

    def current(self) -> VersionAnnouncement:
        """The newest announcement; version -1 before the first publish."""
        return self._current

    def publish(
        self, version: int, store: dict | str | None, manifest_sha256: str | None = None
    ) -> VersionAnnouncement:
        """Announce `version` (its manifest, of SHA-256 `manifest_sha256`, is in the weight
        store `store`)."""
        if version < self.current().version:
            raise ValueError(f"version {version} is older than published {self.current().version}")
        ann = VersionAnnouncement(version=version, store=store, published_at=self.clock(),
                                  manifest_sha256=manifest_sha256)  # fmt: skip
        self.db.put("announcement", ann.model_dump())
        self._current = ann
        return ann

    def swap_to(self, worker_version: int) -> int | None:
        """The version a worker must load first: the newest, when it serves another one.
        A worker AHEAD of the newest holds a version a crashed learner rolled back (the rerun
        republishes that number with other weights), so it is sent back too."""
        newest = self.current().version
        return newest if newest >= 0 and worker_version != newest else None
