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

The KL ceiling (`staleness_kl_max`, 0: none). What a larger S costs is the off-policy gap of
the stale rows: the learner measures it on every trained token as `staleness/kl` (k3 of
KL(behaviour || learner), learner_jax/training/train_step.py) and reports it after each step
(`Controller.report_learner(staleness_kl=...)`), with the batch's mean lag and the S it was
taken under. The rule bounds it from above, before any of the raises above. The default
ceiling, 0.15, is measured (30-step cells of the demo, docs/design/staleness.md): accuracy
fell at S = 4 in every seed (0.52-0.585 against S = 2's 0.705-0.86) and at S = 3 in one of
three; the loss comes in the first ten steps, where the policy moves fastest (an auto run at
S = 2 through them and at 3-4 after kept 0.855). There the 4-batch mean KL peaked at
0.068-0.124 for S = 2 (6 cells), 0.21-0.33 for S = 3 (3 cells), 0.39-0.57 for S = 4 (3
cells): 0.15, about the geometric middle of 0.124 and 0.21, keeps S = 2 and stops S = 3 and
4 in that phase. Kuhn poker's 8e-4 to 2e-2 at S = 1-4 lost nothing.

- **Down by one, at once,** when the batches taken under S' measured a KL above the ceiling
  (the mean of the last `quiet_batches` reports at S': one batch's KL is noisy): S goes to
  S' - 1 (or stays lower), and S' becomes the ceiling: no raise reaches it again.
  This outranks a drop: data dropped as stale is lost, data trained past the ceiling is
  trained on (the demo at S = 4 lost a third of its accuracy with no drop; docs/results.md).
- **No raise past the extrapolated room.** The KL grows at least with the square of the lag
  (a policy drifting steadily moves its log-ratio in proportion to the lag): on Kuhn poker
  KL / lag^2 was 1.4e-3, 1.1e-3, 1.2e-3 at S = 1, 2, 4; on the demo 2.9e-3, 4.3e-3, 1.4e-2
  at S = 1, 2, 3 (faster than the square past 2). So reports of mean KL k at mean lag l (over
  the last reports at the current S) predict k * (S / l)^2 for batches whose lag reaches S:
  a raise goes at most to floor(l * sqrt(ceiling / k)). Counting the lag at the bound S, not
  the mean lag, overestimates where the square law holds (lags spread below S); where the
  KL grows faster, the ceiling catches the overshoot one batch later. Reports with mean lag
  under half a version say nothing of staleness (their KL is the engine's numerics), so
  they leave the room open.
- **The ceiling lifts** by one version once enough batches in a row predicted room at it
  (`quiet_batches` after its first trip, twice as many after each further one): the policy
  moves less per update as training settles (the demo's KL at S = 2 fell from 0.04-0.15 in
  its first ten steps to 0.002-0.03), so a ceiling set early should not bind forever; but
  the square law can underestimate (the demo's S = 3 stayed near 0.14 while S = 2 fell to
  0.015, nine times, where the square predicts 2.9), and the backoff bounds what the
  re-trips cost: each spends one batch past the ceiling.

S always stays in [S_min, S_max]; S_min itself must satisfy the schedule rule
(S_min >= publish_every - 1, bridge/contracts/staleness.py), which the learner's config
check enforces. The current S is the metric `staleness/bound`.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics


@dataclasses.dataclass
class AutoStaleness:
    """The adapting bound. `observe` once per learner batch; it returns the S to use next."""

    s_min: int
    s_max: int
    s: int
    quiet_batches: int = 4
    wait_fraction: float = 0.1
    kl_max: float = 0.0  # the KL ceiling (0: none)
    _dropped_seen: int = 0
    _quiet: int = 0
    kl_ceiling: int | None = None  # the lowest S whose batches measured a KL above kl_max
    kl_trips: int = 0  # how often the ceiling was set or lowered
    _kl_roomy: int = 0  # batches in a row whose KL predicted room at the ceiling
    _kl_reports: dict = dataclasses.field(default_factory=dict)  # S -> its last reports

    def __post_init__(self):
        if not 0 <= self.s_min <= self.s <= self.s_max:
            raise ValueError(
                f"need 0 <= staleness_min <= staleness <= staleness_max, got "
                f"{self.s_min} <= {self.s} <= {self.s_max}"
            )
        if self.quiet_batches < 1 or not 0.0 <= self.wait_fraction or not 0.0 <= self.kl_max:
            raise ValueError(
                f"need quiet_batches >= 1, wait_fraction >= 0 and staleness_kl_max >= 0, got "
                f"{self.quiet_batches}, {self.wait_fraction}, {self.kl_max}"
            )

    def observe(
        self,
        dropped_total: int,
        data_wait_s: float,
        step_s: float,
        model_staleness: int | None,
        estimate: int | None = None,
        kl: KlReport | None = None,
    ) -> int:
        """One batch's evidence: the run's cumulative stale drops, the seconds the learner
        waited for this batch's data, the learner's step time, the capacity model's S (None
        while it is not confident), its estimate before it is (None: none yet) and the
        learner's last KL report (None: none yet). Returns the new S."""
        dropped = dropped_total > self._dropped_seen
        self._dropped_seen = max(self._dropped_seen, dropped_total)
        waited = step_s > 0 and data_wait_s > self.wait_fraction * step_s
        kl = self._smoothed(kl)
        if self._over_ceiling(kl):
            self.s, self._quiet = max(self.s_min, min(self.s, kl.staleness - 1)), 0
            return self.s
        top = self._raise_limit(kl)
        if dropped:
            self.s, self._quiet = max(self.s, min(self.s + 1, top)), 0
        elif waited:
            self._quiet = 0
            if model_staleness is not None:
                self.s = max(self.s, min(model_staleness, top))
            elif estimate is not None and estimate > self.s:
                self.s = max(self.s, min(self.s + 1, top))
        else:
            self._quiet += 1
            if (
                model_staleness is not None
                and model_staleness < self.s
                and self._quiet >= self.quiet_batches
            ):
                self.s, self._quiet = max(self.s - 1, self.s_min), 0
        return self.s

    def _smoothed(self, kl: KlReport | None) -> KlReport | None:
        """`kl` averaged with the last `quiet_batches` - 1 reports on batches taken under its S
        (one batch's KL is noisy: the demo's at S = 2 had median 0.014 and maximum 0.18)."""
        if kl is None:
            return None
        window = self._kl_reports.setdefault(
            kl.staleness, collections.deque(maxlen=self.quiet_batches)
        )
        window.append(kl)
        return KlReport(
            statistics.fmean(r.kl for r in window),
            statistics.fmean(r.lag for r in window),
            kl.staleness,
        )

    def _over_ceiling(self, kl: KlReport | None) -> bool:
        """Whether `kl` is past the ceiling; if so its S becomes (or lowers) the ceiling and
        its reports are forgotten (a later stay at that S is judged afresh)."""
        if not self.kl_max or kl is None or kl.kl <= self.kl_max:
            return False
        del self._kl_reports[kl.staleness]  # _smoothed put it there
        low = self.kl_ceiling
        self.kl_ceiling = kl.staleness if low is None else min(low, kl.staleness)
        self._kl_roomy, self.kl_trips = 0, self.kl_trips + 1
        return True

    def _raise_limit(self, kl: KlReport | None) -> int:
        """The highest S a raise may reach: S_max, the KL's extrapolated room, below the
        ceiling (which lifts after `quiet_batches` * 2^(trips - 1) roomy batches in a row)."""
        room = self.s_max
        evidence = self.kl_max and kl is not None and kl.lag >= 0.5
        if evidence and kl.kl > 0:
            room = math.floor(kl.lag * math.sqrt(self.kl_max / kl.kl))
        if self.kl_ceiling is not None:
            if evidence:  # a batch without a report (or of fresh rows) says nothing of room
                self._kl_roomy = self._kl_roomy + 1 if room >= self.kl_ceiling else 0
            if self._kl_roomy >= self.quiet_batches * 2 ** (self.kl_trips - 1):
                self.kl_ceiling += 1
                self._kl_roomy = 0
            if self.kl_ceiling > self.s_max:
                self.kl_ceiling = None
            else:
                room = min(room, self.kl_ceiling - 1)
        return min(room, self.s_max)


@dataclasses.dataclass(frozen=True)
class KlReport:
    """The learner's `staleness/kl` for one batch, with that batch's mean lag (versions behind
    the learner, over its rows) and the S it was taken under."""

    kl: float
    lag: float
    staleness: int
