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
the last rollouts of each version arrive stale: every kappa updates the learner waits about
kappa * T + latency - S * T for fresh work.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class CapacityReport:
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


def min_staleness(publish_every: int, step_s: float, latency_s: float) -> int:
    """The smallest S with kappa * T + latency <= S * T (see the module docstring)."""
    if publish_every < 1 or step_s <= 0 or latency_s < 0:
        raise ValueError(
            f"need kappa >= 1, T > 0, latency >= 0: {publish_every}, {step_s}, {latency_s}"
        )
    # The epsilon keeps an exact multiple (latency = 2 T) from rounding up to 3 T.
    return publish_every + max(0, math.ceil(latency_s / step_s - 1e-9))


def predicted_utilization(
    active_rollouts_per_s: float,
    rollouts_per_step: float,
    step_s: float,
    staleness: int,
    publish_every: int,
    latency_s: float,
) -> float:
    """Fraction of wall time the learner trains: the rate bound times the freshness stall."""
    rate = min(1.0, active_rollouts_per_s * step_s / max(rollouts_per_step, 1e-12))
    stall = max(0.0, publish_every * step_s + latency_s - staleness * step_s)
    fresh = publish_every * step_s / (publish_every * step_s + stall)
    return rate * fresh


def report(
    active_rollouts_per_s: float,
    rollouts_per_step: float,
    step_s: float,
    staleness: int,
    publish_every: int,
    latency_s: float,
) -> CapacityReport:
    required = required_rollouts_per_s(rollouts_per_step, step_s)
    s_min = min_staleness(publish_every, step_s, latency_s)
    return CapacityReport(
        required_rollouts_per_s=required,
        active_rollouts_per_s=active_rollouts_per_s,
        predicted_utilization=predicted_utilization(
            active_rollouts_per_s, rollouts_per_step, step_s, staleness, publish_every, latency_s
        ),
        min_staleness=s_min,
        rate_ok=active_rollouts_per_s >= required,
        fresh_ok=staleness >= s_min,
    )
