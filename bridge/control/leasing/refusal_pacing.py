"""When a worker refused for a full admission window should ask for work again.

With the window full (leased + buffered groups at what the staleness bound lets the
learner use) no worker can be given rollout work until the learner takes its next batch
(or a lease ends early). A fleet larger than the window, e.g. 2000 workers of 20 s
generations at S=2 (768 groups in flight), kept ~1200 idle workers asking every
`retry_after_s`: 270 refused leases/s, p99 of seconds for everybody. So a refused worker
is told to ask again after `retry_after_s` plus a random delay in [0, waiting workers /
`lease_retry_budget_per_s`]: the idle fleet asks at about the budget in all, load grows
with the work on offer, not with idle workers. A small fleet (waiting / budget << 0.5 s)
asks as before. A first version also told workers to wait for the learner's next batch
(its measured pace) and answered "full" before "behind" (so idle workers would not fetch
every version): a two-worker run then lost throughput (tests/bridge/plan_from_run_test.py,
cost per step 46-55% off the plan): a data-bound learner's batch comes when the work
arrives, not on a schedule, and a worker that swaps only once admitted idles meanwhile.
"""

from __future__ import annotations

import random
import threading

from bridge.control.config import ControllerConfig


class RefusalPacing:
    def __init__(self, config: ControllerConfig):
        self.config = config
        self._lock = threading.Lock()
        self._rng = random.Random(config.seed)
        self._refused: dict[str, float] = {}  # worker -> when it was last refused as full
        self._waiting = (float("-inf"), 0)  # (counted at, workers refused recently)

    def full_retry_s(self, worker_id: str, now: float) -> float:
        """`retry_after_s` for `worker_id`, refused now because the window is full."""
        c = self.config
        with self._lock:
            self._refused[worker_id] = now
            at, waiting = self._waiting
            if now - at >= 1.0:  # recount at most once a second: O(idle fleet)
                cutoff = now - c.worker_timeout_s
                self._refused = {w: t for w, t in self._refused.items() if t >= cutoff}
                waiting = len(self._refused)
                self._waiting = (now, waiting)
            spread = waiting / c.lease_retry_budget_per_s if c.lease_retry_budget_per_s else 0.0
            return c.retry_after_s + self._rng.uniform(0.0, spread)

    def admitted(self, worker_id: str) -> None:
        """`worker_id` got work: it no longer waits."""
        with self._lock:
            self._refused.pop(worker_id, None)
