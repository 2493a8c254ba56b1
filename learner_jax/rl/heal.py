"""Healing a version the workers cannot load, while the learner waits for a batch.

    healer = VersionHealer(ctl, publisher)
    source = batches.BatchSource(..., check_fleet=lambda: (follower.check(), healer.check()))

A worker that cannot load the newest announced version (a chunk corrupt or torn in the
store: it verifies every digest) says so in its lease requests; the controller keeps the
report (bridge/control/leasing/liveness.py). With S = 2 and the two newest versions corrupt before
any worker loaded them, no worker can serve a version the learner may consume and the
learner cannot publish without a batch: nothing moves. The learner holds the newest
parameters, so it publishes them again (`WeightPublisher.republish`, learner_jax/rl/
weights.py) and the workers retry the version announced again (rollout_gpu/versions.py).

Each version is re-published at once on its first report, then at most every `first_wait_s`
doubling to `max_wait_s` while reports keep coming (a worker's request sent before it heard
the re-announcement still carries the old report; a store that keeps corrupting what is
written gets a bounded rate of rewrites).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class VersionHealer:
    def __init__(
        self,
        ctl,
        publisher,
        *,
        first_wait_s: float = 10.0,
        max_wait_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.ctl, self.publisher, self.clock = ctl, publisher, clock
        self.first_wait_s, self.max_wait_s = first_wait_s, max_wait_s
        self._last: tuple[int, float, float] | None = None  # (version, at, wait before next)
        self.healed: list[int] = []  # the versions re-published, in order

    def check(self) -> bool:
        """Re-publish the newest version if workers report it unloadable; True if it did."""
        version = self.ctl.unloadable_version()
        if version < 0:
            return False
        now, wait = self.clock(), self.first_wait_s
        if self._last is not None and self._last[0] == version:
            _, at, last_wait = self._last
            if now < at + last_wait:
                return False
            wait = min(self.max_wait_s, 2 * last_wait)
        if self.publisher.republish(version) is None:
            return False
        self._last = (version, self.clock(), wait)
        self.healed.append(version)
        return True
