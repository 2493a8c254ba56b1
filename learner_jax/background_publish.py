"""Publishing weight versions off the learner's critical path.

    publisher = BackgroundPublisher(publish_fn)   # publish_fn(version, params) -> None
    publisher.submit(step, params_snapshot)       # returns at once
    publisher.flush()                             # wait for everything submitted

ECHO-2 overlaps weight dissemination with training: the learner hands a snapshot of its
parameters to one background thread, which computes the canary, writes the version to the
weight store and announces it, while the learner already runs the next step. Versions go
out in order; if the learner submits a newer version while an older one still waits (the
store is slower than a step), the older one is skipped (latest wins, counted in
`skipped`): workers only ever want the newest, and the staleness bound is enforced where
trajectories are consumed, not here. A failed publish is re-raised on the learner's
thread at its next `submit` or `flush`, so a broken store stops the run instead of
silently freezing the fleet on an old version.

The snapshot must be a copy: the train step donates the state's buffers, so the next
step would delete arrays the publisher is still reading. Copying costs one extra set of
parameters in device memory (not optimizer state).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class PublishError(RuntimeError):
    """A background publish failed; the run cannot keep its fleet current."""


class BackgroundPublisher:
    def __init__(self, publish_fn: Callable[[int, Any], None]):
        self._fn = publish_fn
        self._cv = threading.Condition()
        self._pending: tuple[int, Any] | None = None
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self.skipped = 0  # versions replaced by a newer one before they started
        self.last_version = -1  # newest version fully published
        self.last_s = 0.0  # how long that publish took (on the publisher's thread)
        self._thread = threading.Thread(target=self._loop, daemon=True, name="publisher")
        self._thread.start()

    def submit(self, version: int, params: Any) -> None:
        with self._cv:
            self._raise_if_failed()
            if self._closed:
                raise PublishError("publisher is closed")
            if self._pending is not None:
                self.skipped += 1
            self._pending = (version, params)
            self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Waits until every submitted version is published; False on timeout."""
        with self._cv:
            done = self._cv.wait_for(
                lambda: self._error is not None or (self._pending is None and not self._busy),
                timeout,
            )
            self._raise_if_failed()
            return done

    def close(self, timeout: float | None = None) -> None:
        """Publishes what is pending, then stops the thread (errors are re-raised)."""
        try:
            self.flush(timeout)
        finally:
            with self._cv:
                self._closed = True
                self._cv.notify_all()
            self._thread.join(timeout)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise PublishError(
                f"background publish failed: {type(self._error).__name__}: {self._error}"
            ) from self._error

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return  # closed and drained
                version, params = self._pending
                self._pending, self._busy = None, True
            t0 = time.perf_counter()
            try:
                self._fn(version, params)
            except BaseException as e:  # noqa: BLE001 - handed to the learner's thread
                with self._cv:
                    self._error, self._busy = e, False
                    self._cv.notify_all()
                return
            with self._cv:
                self._busy = False
                self.last_version, self.last_s = version, time.perf_counter() - t0
                self._cv.notify_all()
