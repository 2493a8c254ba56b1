"""The capacity model: how much rollout throughput keeps the learner busy, and which S.

Symbols (PAPER.md, "Our derivation"): T = T_train, the learner's time per update; R the
rollouts it consumes per update; mu_i a worker's rollouts/s; kappa the publish period;
T_pub + T_bcast + T_gen = `latency_s`, the time from the end of the update that makes a
version until a rollout generated with it is back at the controller.

Rate condition: sum_{i active} mu_i >= R / T, so the requirement is R / T rollouts/s and,
when it fails, the learner is busy a fraction sum(mu) * T / R of the time.

Freshness condition, with versions as in this code base (version v = params after v
updates; a batch consumed while the learner has done t updates may hold versions
x >= t - S). Version v is published when update v ends. Workers keep generating with v
until v + kappa reaches them, so the LAST rollout made with v starts kappa * T + T_pub +
T_bcast after update v ends and is back T_gen later; it must arrive before the learner
starts its update at step v + S, S * T after update v ended:

    kappa * T + T_pub + T_bcast + T_gen <= S * T,  i.e.  S >= kappa + ceil(latency / T).

This is one step more than PAPER.md's derivation (S >= kappa - 1 + ceil(latency / T)):
that version counts the window from the start of the update that makes v. With kappa = 1
and a negligible latency it would allow S = 0, which is synchronous training (the learner
waits for every batch to be generated), so it cannot be the condition for overlap. Under
the paper's reported default kappa = S - 1, ours says latency <= T whatever S (theirs:
<= 2 T): a larger S with kappa = S - 1 only publishes less often. When the condition fails,
the last rollouts of each version arrive stale and the learner may wait for fresh work.

That condition asks for EVERY rollout of a version, which only an exactly provisioned fleet
needs. A fleet with rho = sum(mu) * T / R > 1 overproduces: the first R rollouts of a
version are back L + T / rho after it is published (L = latency), the rest are spare.
Utilization, with stalls only at the first update that needs a newer version (one in kappa):
version v (a multiple of kappa) ends update v; the first update k1 = v + S + 2 - kappa that
cannot use an older version starts after the S + 1 - kappa updates in between and the
floor((S + 1) / kappa) stalls of length X among v + 1 .. k1, and it must wait until the
first R rollouts of v are in:

    (S + 1 - kappa) * T + floor((S + 1) / kappa) * X = L + T / rho,
    utilization = min(rho, kappa * T / (kappa * T + max(0, X))).

With rho = 1 it is busy iff S >= kappa + L / T, our freshness condition above; with spare
throughput the learner tolerates up to T * (1 - 1 / rho) more latency. Against the planner's
simulation (bridge/plan/simulate.py, bench/plan_sweep.py's freshness fleet, T = 10 s) it is
within 0.03 and below it (by up to 0.005 above at the exact threshold, where the
simulation's lease jitter helps or hurts), on 60 cases (S 2-5, kappa 1-4, L / T 0.5-2.5,
rho 1 and 1.25). Exact fleet, kappa = 1, S = 2, L / T = 1.1 / 1.5 / 2.0 / 2.5:
formula 0.968 / 0.857 / 0.750 / 0.667, simulated 0.983 / 0.887 / 0.773 / 0.685; kappa = 2,
S = 3, L = 2 T: 0.800 vs 0.818; kappa = 4, S = 5, L = 2 T: 0.800 vs 0.821; 25% spare,
kappa = 2, S = 3, L = 2 T: 0.833 vs 0.855. The previous closed form (a stall of
kappa * T + L - S * T every kappa updates) gave 0.50 at kappa = 1, S = 2, L = 2 T.

The broadcast's own throughput: a version cannot enter the broadcast before the previous
one has passed its bottleneck (`broadcast_period_s`, bridge/plan/links.period: for the
store the time until its last download ends, for a pipeline M / its slowest link). When
that period exceeds kappa * T, versions published meanwhile are skipped, so the fleet
effectively sees a new version every kappa_eff = max(kappa, ceil(period / T)) updates,
and both formulas use kappa_eff: S >= max(kappa, ceil(period / T)) + ceil(latency / T),
a fit to the simulation. The default period 0 keeps kappa (the live controller does not
know the period; the local file store's is negligible).

A fleet of unequal workers (issue 32): L + T / rho assumes every worker delivers with the
same delay. Worker i (delay d_i = its swap + one lease, rate mu_i) returns rollouts of a new
version from d_i on, so the first R are back at the smallest tau with
sum_i mu_i * max(0, tau - d_i) >= R (`arrival_s`; one worker: d + R / mu = L + T / rho).
Judged by the slowest worker instead, a 30-step run of the demo config (a fast worker and a
throttled one, the fleet short: rho 0.65) was predicted 0.49 against 0.65 measured: the fast
worker alone brings the first R back long before the throttled one's first lease.

Warm measurements only (issue 32). The live model (fleet_plan.py) is fed measurements whose
first ones are not the steady state: the learner's first update includes the train step's
XLA compile (3.8 s against 0.25 s later on the 2-core box), a worker's first lease vLLM's
first-call kernel compile, its first two swaps the engine start and the first weight
reload (20 s and more). Fed those, the demo's first verdict was "utilization 60%, raise S to
5" for a run that then held 0.76-0.98 at S = 2. `Warmup` names what is cold and how many
warm samples a verdict needs; `WarmSamples` keeps one quantity's warm samples and
estimates it by their median (one slow checkpoint step or a loaded-box hiccup does not move
it). Estimates fall back to the cold samples while no warm one exists (the metrics and
activation need a number from the first lease on), but advice is given only when the
prediction is `confident`: every input has at least `min_warm` warm samples.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
import statistics

from bridge.contracts import staleness as staleness_rule

# The freshness bound is a lower bound within 0.03 of the simulation (module docstring): a
# predicted stall smaller than that is no reason to advise (a 30-step run of the demo config
# raised `capacity/warning` for a predicted utilization of 0.9999).
FRESH_SLACK = 0.03


@dataclasses.dataclass(frozen=True)
class CapacityReport:
    """`fresh_ok`: S >= min_staleness, or the fleet's spare throughput covers the gap (the
    freshness bound of predicted_utilization is 1, within FRESH_SLACK)."""

    required_rollouts_per_s: float
    active_rollouts_per_s: float
    predicted_utilization: float
    min_staleness: int
    rate_ok: bool
    fresh_ok: bool

    def advice(self, staleness: int) -> str | None:
        """A sentence naming the fix, or None when the fleet and S keep the learner busy."""
        parts = []
        if not self.rate_ok:
            parts.append(
                f"the active fleet makes {self.active_rollouts_per_s:.2f} rollouts/s but the "
                f"learner needs {self.required_rollouts_per_s:.2f}: add workers (or activate "
                "standby ones)"
            )
        if not self.fresh_ok:
            parts.append(
                f"staleness S={staleness} is below the {self.min_staleness} the measured "
                f"latencies need: raise `staleness` to {self.min_staleness} or lower "
                "`publish_every`"
            )
        return "; ".join(parts) or None


def required_rollouts_per_s(rollouts_per_step: float, step_s: float) -> float:
    """R / T: the throughput at which the learner never waits for data."""
    if step_s <= 0:
        raise ValueError(f"learner step time must be > 0, got {step_s}")
    return rollouts_per_step / step_s


def effective_publish_every(publish_every: int, step_s: float, broadcast_period_s: float) -> int:
    """kappa_eff = max(kappa, ceil(period / T)): versions the broadcast cannot carry are skipped."""
    return max(publish_every, math.ceil(broadcast_period_s / step_s - 1e-9))


def min_staleness(
    publish_every: int, step_s: float, latency_s: float, broadcast_period_s: float = 0.0
) -> int:
    """The smallest S with kappa_eff * T + latency <= S * T (see the module docstring)."""
    if publish_every < 1 or step_s <= 0 or latency_s < 0 or broadcast_period_s < 0:
        raise ValueError(
            "need kappa >= 1, T > 0, latency >= 0, period >= 0: "
            f"{publish_every}, {step_s}, {latency_s}, {broadcast_period_s}"
        )
    kappa = effective_publish_every(publish_every, step_s, broadcast_period_s)
    # The epsilon keeps an exact multiple (latency = 2 T) from rounding up to 3 T.
    return kappa + max(0, math.ceil(latency_s / step_s - 1e-9))


def arrival_s(workers, rollouts: float) -> float:
    """When the first `rollouts` of a new version are back from `workers`, (delay_i, mu_i)
    pairs: the smallest tau with sum_i mu_i * max(0, tau - delay_i) >= rollouts (module
    docstring); inf when no worker produces."""
    t, done, rate = 0.0, 0.0, 0.0
    for delay, mu in sorted((d, mu) for d, mu in workers if mu > 0):
        if rate > 0 and done + rate * (delay - t) >= rollouts:
            break
        done += rate * max(0.0, delay - t)
        t, rate = max(t, delay), rate + mu
    return t + (rollouts - done) / rate if rate > 0 else math.inf


def predicted_utilization(
    active_rollouts_per_s: float,
    rollouts_per_step: float,
    step_s: float,
    staleness: int,
    publish_every: int,
    latency_s: float,
    broadcast_period_s: float = 0.0,
    first_rollouts_s: float | None = None,
) -> float:
    """Fraction of wall time the learner trains: the lower of the rate bound rho and the
    freshness bound (module docstring; a lower bound of the simulated utilization).
    `first_rollouts_s`: when the first R rollouts of a version are back after its publish
    (`arrival_s` plus T_pub, for an unequal fleet); default latency + T / rho."""
    rho = active_rollouts_per_s * step_s / max(rollouts_per_step, 1e-12)
    if rho <= 0:
        return 0.0
    kappa = effective_publish_every(publish_every, step_s, broadcast_period_s)
    # Stalls in v + 1 .. k1 (updates = k1 mod kappa); at least k1's own when S + 1 < kappa_eff
    # (skipped versions: the learner waits for the next one that arrives).
    usable = staleness_rule.usable_steps(staleness)  # S + 1 steps may consume one version
    stalls = max(1, usable // kappa)
    first = latency_s + step_s / rho if first_rollouts_s is None else first_rollouts_s
    stall = (first - (usable - kappa) * step_s) / stalls
    fresh = kappa * step_s / (kappa * step_s + max(0.0, stall))
    return min(1.0, rho, fresh)


def report(
    active_rollouts_per_s: float,
    rollouts_per_step: float,
    step_s: float,
    staleness: int,
    publish_every: int,
    latency_s: float,
    broadcast_period_s: float = 0.0,
    first_rollouts_s: float | None = None,
) -> CapacityReport:
    """`first_rollouts_s` (see `predicted_utilization`) moves the prediction only; the
    verdicts keep the exact-fleet bound on `latency_s`."""
    required = required_rollouts_per_s(rollouts_per_step, step_s)
    s_min = min_staleness(publish_every, step_s, latency_s, broadcast_period_s)
    return CapacityReport(
        required_rollouts_per_s=required,
        active_rollouts_per_s=active_rollouts_per_s,
        predicted_utilization=predicted_utilization(
            active_rollouts_per_s,
            rollouts_per_step,
            step_s,
            staleness,
            publish_every,
            latency_s,
            broadcast_period_s,
            first_rollouts_s,
        ),
        min_staleness=s_min,
        rate_ok=active_rollouts_per_s >= required,
        # min S is the bound for an exactly provisioned fleet; spare throughput also keeps
        # the learner fed (the freshness bound alone, rho capped at 1, stays at 1).
        fresh_ok=staleness >= s_min
        or predicted_utilization(
            max(active_rollouts_per_s, required),
            rollouts_per_step,
            step_s,
            staleness,
            publish_every,
            latency_s,
            broadcast_period_s,
        )
        >= 1.0 - FRESH_SLACK,
    )


def busy_rate(leases) -> tuple[float, float]:
    """(rollouts per busy second, mean lease duration) of (issued, done, rollouts) leases."""
    busy, end = 0.0, -math.inf
    for t0, t1, _ in sorted(leases):
        busy += max(0.0, t1 - max(t0, end))
        end = max(end, t1)
    rollouts = sum(n for _, _, n in leases)
    return rollouts / max(busy, 1e-9), sum(t1 - t0 for t0, t1, _ in leases) / len(leases)


def own_rate(leases, held_back=()) -> float:
    """Rollouts per second of the worker's own time: the time it held a lease, plus the gaps
    between its leases (its round trips, swaps, loop) up to the first time in the gap that
    the controller held it back (`FleetPlan.held_back`: admission full, too slow; not its
    slowness).

    Busy time alone overstated a fast worker: on a quiet 2-core box the demo fleet's fast
    worker ran 65 ms leases with ~8 ms between them, and the capacity model predicted 9
    points above the measured utilization (BUILD_NOTES, issue 32)."""
    # A gap longer than a lease is no round trip or swap load but an outage (a stall, a
    # restart): counted up to one mean lease, so one outage does not set the steady rate.
    cap = sum(t1 - t0 for t0, t1, _ in leases) / max(len(leases), 1)
    busy, gaps, end = 0.0, 0.0, None
    for t0, t1, _ in sorted(leases):
        if end is not None and t0 > end:
            stops = [t for t in held_back if end <= t <= t0]
            gaps += min(cap, (min(stops) if stops else t0) - end)
        busy += max(0.0, t1 - max(t0, end if end is not None else t0))
        end = t1 if end is None else max(end, t1)
    n = len(leases)  # n leases have n - 1 gaps between them: scale to one gap per lease
    own = busy + (gaps * n / (n - 1) if n > 1 else 0.0)
    return sum(n for _, _, n in leases) / max(own, 1e-9)


@dataclasses.dataclass(frozen=True)
class Warmup:
    """What the live model leaves out as cold, and when its verdict is confident."""

    cold_steps: int = 1  # learner reports: the first includes the train step's XLA compile
    # The learner's first overhead reports: the run settling (in every plan_from_run_test run
    # the 3rd carried a 0.16-0.2 s one-off in taking the batch, 3-5x the steady overhead, and
    # as a mean of a few samples it held the first verdict's O at 0.06-0.12 s vs 0.03 s).
    cold_overheads: int = 3
    cold_leases: int = 1  # per worker: the first lease includes vLLM's kernel compile
    cold_swaps: int = 2  # per worker: the initial load (engine start) and the first reload
    # Warm samples of T and of each counted worker's leases and swaps before a verdict: with
    # 3, the first verdict's fleet rate swung enough between runs of plan_from_run_test to
    # name a utilization 7 points under the measured one; with 5, within 4 (BUILD_NOTES).
    min_warm: int = 5
    keep: int = 16  # warm samples kept per quantity (recent enough to track change)


class WarmSamples:
    """One measured quantity: the first `cold` samples (and any flagged cold) left out, the
    last `keep` warm ones kept; `estimate()` is their median, else the last cold sample."""

    def __init__(self, cold: int, keep: int = 16):
        self.cold, self.seen = cold, 0
        self.warm: collections.deque = collections.deque(maxlen=keep)
        self.last_cold: float | None = None

    def add(self, sample: float, cold: bool = False) -> bool:
        """Record a sample; True if it counts as warm."""
        self.seen += 1
        if cold or self.seen <= self.cold:
            self.last_cold = sample
            return False
        self.warm.append(sample)
        return True

    def __len__(self) -> int:
        return len(self.warm)

    def copy(self) -> WarmSamples:
        out = copy.copy(self)
        out.warm = self.warm.copy()
        return out

    def estimate(self) -> float | None:
        if self.warm:
            return statistics.median(self.warm)
        return self.last_cold

    def mean(self) -> float | None:
        """For costs paid on average (rare long spikes count): the warm samples' mean."""
        if self.warm:
            return statistics.fmean(self.warm)
        return self.last_cold
