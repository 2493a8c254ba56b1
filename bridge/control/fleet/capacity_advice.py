"""What the console says about capacity (bridge/control/fleet/fleet_plan.py computes the verdict).

The log names the fix (`CapacityReport.advice`) when the verdict gets worse (a new cause, or
a larger S needed), at most once a minute, and repeats an unchanged verdict every 10
minutes: a per-minute repeat of the same advice filled the demo's console without saying
anything new. A verdict that improves is "capacity: updated", one the warm data no longer
supports "capacity: withdrawn" (console INFO lines, at most one a minute with the
warnings). No verdict is given, or taken back, before the prediction is confident.
"""

from __future__ import annotations

import logging
import math

from bridge.control.fleet import capacity

_WARN_EVERY_S = 60.0  # at most one capacity warning a minute
_WARN_REPEAT_S = 600.0  # the same verdict again after this long


class Advice:
    def __init__(self, staleness: int):
        self.staleness = staleness
        self._warned_at = -math.inf
        self._warned_causes: frozenset[str] = frozenset()
        self._warned_staleness = 0  # the largest min_staleness a warning named

    def say(
        self,
        rep: capacity.CapacityReport,
        now: float,
        confident: bool = True,
        step_s: float = math.nan,
        latency_s: float = math.nan,
        overhead_s: float = 0.0,
    ) -> None:
        if not confident:  # too few warm samples: no verdict, and none taken back
            return
        checks = (("rate", rep.rate_ok), ("fresh", rep.fresh_ok))
        causes = frozenset(k for k, ok in checks if not ok)
        since = now - self._warned_at
        basis = f"warm T {step_s:.2f}s, learner overhead {overhead_s:.2f}s"
        basis += f", latency {latency_s:.2f}s"
        worse = bool(causes - self._warned_causes) or (
            "fresh" in causes and rep.min_staleness > self._warned_staleness
        )
        # Better than what was said: every cause gone, one gone, or a smaller S enough.
        better = not worse and (
            causes < self._warned_causes
            or ("fresh" in causes and rep.min_staleness < self._warned_staleness)
        )
        if not causes or better:
            if not self._warned_causes or since < _WARN_EVERY_S:
                return
            self._warned_at, self._warned_causes = now, causes
            self._warned_staleness = rep.min_staleness if "fresh" in causes else 0
            logging.info(
                "capacity: %s (predicted utilization %.0f%%, %s)%s",
                "updated" if causes else "withdrawn, the fleet and S keep the learner busy",
                100 * rep.predicted_utilization,
                basis,
                f": {rep.advice(self.staleness)}" if causes else "",
                extra={"console": True},
            )
            return
        if since < _WARN_EVERY_S or (not worse and since < _WARN_REPEAT_S):
            return
        self._warned_at, self._warned_causes = now, self._warned_causes | causes
        if "fresh" in causes:
            self._warned_staleness = max(self._warned_staleness, rep.min_staleness)
        logging.warning(
            "capacity: the learner will wait (predicted utilization %.0f%%, %s): %s",
            100 * rep.predicted_utilization,
            basis,
            rep.advice(self.staleness),
        )
