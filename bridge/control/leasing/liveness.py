"""Whether the run can make progress: unloadable versions, stuck workers, the learner's pace.

`Liveness` is a part of `Controller` (bridge/control/controller.py); the caller holds the
controller's lock, except for a heartbeat's `claimed` (no lock there: hot_state.py), which
takes this part's own small lock. It owns three facts, all in memory (a restarted
controller starts over: the workers report again within a heartbeat, the learner within a
step):

- which announced version workers report they cannot load (`unloadable_version` in their
  lease requests and heartbeats: corrupt or torn in the store; a worker with no version
  loaded asks for no lease). The learner asks (`unloadable()`) while it
  waits for a batch and re-publishes that version from the parameters it holds
  (learner_jax/rl/heal.py); a re-announcement clears the reports of that version.
- whether any work is admissible at all (`no_admissible_work`): with S = 2 and the two
  newest versions corrupt, a worker still on the version before them is "behind" and cannot
  swap, and the learner cannot publish without a batch. Nothing moves until the version is
  re-published; that is said once in the log and as `fleet/no_admissible_work` = 1 in every
  stats line (and on /metrics) while it lasts.
- when the learner last finished a train step (`learner/since_last_step_s`: a stall's
  length, the liveness check's input; bench/chaos_audit.py bounds it).
"""

from __future__ import annotations

import logging
import threading

from bridge.contracts import staleness as staleness_rule


class Liveness:
    def __init__(self, staleness: int, groups_per_step: int, max_version_lag: int, now: float):
        self.staleness, self.groups_per_step = staleness, groups_per_step
        self.max_version_lag = max_version_lag
        self._reported: dict[int, str] = {}  # version -> a worker that reported it unloadable
        self._claims: dict[str, tuple[int, int]] = {}  # worker -> (version, unloadable_version)
        self._last_step_at = now  # the controller's start counts as a step: a run starts
        self._stuck_since: float | None = None
        self._lock = threading.Lock()

    # -- reports -------------------------------------------------------------------------
    def claimed(self, worker_id: str, version: int, unloadable: int, newest: int) -> None:
        """A lease request's or heartbeat's claims: the version the worker serves and the
        one it could not load; a report of the newest version is kept."""
        with self._lock:
            self._claims[worker_id] = (version, unloadable)
            if unloadable != newest or newest < 0 or newest in self._reported:
                return
            self._reported[newest] = worker_id
            logging.warning(
                "worker %s cannot load version %d (corrupt in the store?): asking the "
                "learner to publish it again",
                worker_id,
                newest,
            )

    def published(self, version: int) -> None:
        """`version` was announced (again): earlier reports of it are about another copy."""
        with self._lock:
            self._reported = {v: w for v, w in self._reported.items() if v > version}

    def unloadable(self, newest: int) -> int:
        """The newest announced version if a worker reported it unloadable since its latest
        announcement, else -1."""
        return newest if newest in self._reported else -1

    def forget(self, worker_id: str) -> None:
        with self._lock:
            self._claims.pop(worker_id, None)

    # -- the learner's pace ----------------------------------------------------------------
    def stepped(self, now: float) -> None:
        self._last_step_at = now

    def since_last_step_s(self, now: float) -> float:
        return max(0.0, now - self._last_step_at)

    # -- admissible work -------------------------------------------------------------------
    def no_admissible_work(
        self, now: float, newest: int, next_step: int, live: dict[str, int], held: int
    ) -> bool:
        """True when no live worker can be given work it could serve and nothing is held
        (leased or buffered) toward a batch: every live worker last said it cannot load the
        newest version, and the version it serves is behind or too stale to admit. Logged
        when it starts and when it ends."""
        stuck = newest >= 0 and held < self.groups_per_step and bool(live)
        if stuck:
            stuck = all(self._stuck(w, v, newest, next_step, held) for w, v in live.items())
        if stuck and self._stuck_since is None:
            self._stuck_since = now
            oldest = staleness_rule.oldest_fresh(next_step, self.staleness)
            logging.warning(
                "no admissible work: all %d live workers serve versions <= %d and cannot load "
                "version %d (reported unloadable); learner step %d needs versions >= %d with "
                "at most %d behind the newest: waiting for the learner to publish again",
                len(live),
                max(live.values()),
                newest,
                next_step,
                oldest,
                self.max_version_lag,
            )
        elif not stuck and self._stuck_since is not None:
            logging.info("admissible work again after %.1fs without any", now - self._stuck_since)
            self._stuck_since = None
        return stuck

    def _stuck(self, worker_id: str, version: int, newest: int, next_step: int, held: int) -> bool:
        with self._lock:
            claimed, unloadable = self._claims.get(worker_id, (version, -1))
        if unloadable != newest:
            return False  # it will swap to the newest (or is fetching it)
        version = min(max(version, claimed), newest)
        behind = newest - version - 1 > self.max_version_lag  # leasing.py: one is forgiven
        cap = staleness_rule.admission_capacity(
            version, next_step, self.staleness, self.groups_per_step
        )
        return behind or cap - held <= 0
