"""`staleness="auto"`: the controller moves S within the user's bounds [S_min, S_max].

Why S should move: a larger S costs quality (more off-policy data: the staleness sweep's
demo falls from S = 2 without a correction, docs/guides/choosing-s.md) and buys utilization
only up to the S the fleet's latency needs; past it the learner is already fed. That S is
the capacity model's freshness condition (bridge/control/fleet/capacity.py), measured live by the
fleet plan as `capacity/min_staleness` = kappa_eff + ceil(latency / T). So the rule aims at
the smallest S that keeps the learner fed, and takes evidence over the model:

- **Up by one** when a group was dropped as stale since the last batch: a rollout came back
  more than S versions late, so at S + 1 it would have been used. A drop is direct evidence
  that the window is too short whatever the model says.
- **Up to the model's S** when the learner waited for data (`time/data_wait_s` above
  `wait_fraction` of its step time) and the confident capacity model says the freshness
  condition needs more than the current S. Waiting on a fleet that is merely too small (the
  rate bound) is not fixed by a larger S, so waiting alone moves nothing.
- **Up by one, provisionally,** when the learner waited and the model, not confident yet,
  estimates more than the current S. The model's estimate settles within a step or two but
  its confidence takes several batches (capacity.Warmup); waiting at S_min meanwhile cost
  the demo a third of its utilization over a 12-step run (docs/results.md). One step per
  waited batch, never past the estimate: a wrong estimate costs at most what the down rule
  takes back once the model is confident.
- **Down by one** when the confident model's S is below the current one and the last
  `quiet_batches` batches had neither a drop nor a wait: the window is longer than the fleet
  needs. One step at a time, and only after a quiet stretch, so a short lull does not give
  up the window a burst of slow leases needs (hysteresis against oscillation).

S always stays in [S_min, S_max]; S_min itself must satisfy the schedule rule
(S_min >= publish_every - 1, bridge/contracts/staleness.py), which the learner's config
check enforces. The current S is the metric `staleness/bound`.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class AutoStaleness:
    """The adapting bound. `observe` once per learner batch; it returns the S to use next."""

    s_min: int
    s_max: int
    s: int
    quiet_batches: int = 4
    wait_fraction: float = 0.1
    _dropped_seen: int = 0
    _quiet: int = 0

    def __post_init__(self):
        if not 0 <= self.s_min <= self.s <= self.s_max:
            raise ValueError(
                f"need 0 <= staleness_min <= staleness <= staleness_max, got "
                f"{self.s_min} <= {self.s} <= {self.s_max}"
            )
        if self.quiet_batches < 1 or not 0.0 <= self.wait_fraction:
            raise ValueError(
                f"need quiet_batches >= 1 and wait_fraction >= 0, got "
                f"{self.quiet_batches}, {self.wait_fraction}"
            )

    def observe(
        self,
        dropped_total: int,
        data_wait_s: float,
        step_s: float,
        model_staleness: int | None,
        estimate: int | None = None,
    ) -> int:
        """One batch's evidence: the run's cumulative stale drops, the seconds the learner
        waited for this batch's data, the learner's step time, the capacity model's S (None
        while it is not confident) and its estimate before it is (None: none yet). Returns
        the new S."""
        dropped = dropped_total > self._dropped_seen
        self._dropped_seen = max(self._dropped_seen, dropped_total)
        waited = step_s > 0 and data_wait_s > self.wait_fraction * step_s
        if dropped:
            self.s, self._quiet = min(self.s + 1, self.s_max), 0
        elif waited:
            self._quiet = 0
            if model_staleness is not None:
                if model_staleness > self.s:
                    self.s = min(model_staleness, self.s_max)
            elif estimate is not None and estimate > self.s:
                self.s = min(self.s + 1, self.s_max)
        else:
            self._quiet += 1
            if (
                model_staleness is not None
                and model_staleness < self.s
                and self._quiet >= self.quiet_batches
            ):
                self.s, self._quiet = max(self.s - 1, self.s_min), 0
        return self.s
