"""Keep the provisioned fleet alive and following the controller's activation decision.

    follower = FleetFollower(ctl.status, provs, FollowConfig(activation=True), log_dir)
    follower.check()        # while waiting for a batch and after each step (cheap)
    follower.close()        # after the run is over: stop every worker and wait

Every `period_s` one pass over the controller's status table (bridge/fleet/reconcile.py),
per provisioner:
- dead workers (exited, or reported gone/quarantined) are replaced ("...: replace dead");
- with activation on, workers the controller put on standby are released
  ("activation: standby": nobody pays for a machine that gets no leases), and when the
  capacity model says the active fleet is short (required > active rollouts/s on a
  confident prediction; not on a freshness-only `capacity/warning`, which more workers do
  not fix) one worker is started
  ("activation: short") if the limits allow, the cheapest kind first, never in a pass that
  released standby workers, then no other until every started worker has joined and
  `short_cooldown_s` passed (the new worker must be measured before judging again);
- a worker the controller has refused as too slow (state `too_slow`, lease_timing.py: its
  leases come back after its work went stale) for `standby_release_s` is put on standby and
  released like any idle worker ("too slow: standby"), activation on or off: it gets no
  work but is billed. The default (90 s) outlasts the controller's re-measuring period
  (`retest_slow_after_s`, 60 s), so the refusal that releases it rests on at least one lease
  after its first (cold: vLLM's compile). A re-measuring lease shows it briefly not refused;
  only `3 * period_s` without a refusal (it became useful: the learner slowed) starts the
  count again. Its stop line in provisioner.jsonl carries the paid idle time (`idle_s`,
  `idle_usd`, from the first pass that saw it refused), which the run summary adds up. A
  hand-started worker has no provisioner: lease_timing.py says it once, with its price.
Every start and stop goes through a provisioner, so `<workdir>/provisioner.jsonl` has it
with its reason and cost.

A kind of worker that keeps dying (`max_deaths` within `death_window_s`, e.g. a broken
install crashing at import) fails the run with its log's path instead of being restarted
forever; one death is only replaced.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable

from bridge.config.keys import SCHEMA
from bridge.fleet.provisioner import Provisioner
from bridge.fleet.reconcile import handle_states, reconcile

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
@SCHEMA.declared_fields
class FollowConfig:
    """How the fleet follows the controller. Fields besides these: activation (follow the
    controller's decision), max_deaths, death_window_s, standby_release_s (refused as too
    slow this long: released; inf = never), declared in bridge/config/keys.py."""

    period_s: float = SCHEMA.default("fleet.follow_period_s")
    short_cooldown_s: float = 60.0
    # The limits resolved over all provisioners (fleet.max_workers 0 = local_workers,
    # fleet.max_usd_per_hour 0 = no limit), so their defaults are not the keys'.
    max_workers: int = 8
    max_usd_per_hour: float = math.inf
    wait_s: float = 20.0  # close(): how long to wait for local processes to exit


class FleetFollower:
    def __init__(
        self,
        status: Callable[[], dict],
        provs: list[Provisioner],
        cfg: FollowConfig,
        log_dir: str,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.status, self.provs, self.cfg, self.log_dir = status, provs, cfg, log_dir
        self.clock = clock
        self._last = -math.inf
        self._last_short = -math.inf
        self._deaths = [collections.deque() for _ in provs]
        self._slow: dict[str, list[float]] = {}  # name -> [first, last] pass it was refused
        self.replaced = self.released = self.added = 0
        self.slow_released, self.slow_idle_s, self.slow_idle_usd = 0, 0.0, 0.0

    def _log_path(self, name: str) -> str:
        return os.path.join(self.log_dir, f"{name}.log")

    def check(self, force: bool = False) -> None:
        """One reconciliation pass, at most every `period_s` unless `force`."""
        now = self.clock()
        if not force and now - self._last < self.cfg.period_s:
            return
        self._last = now
        if not any(p.handles for p in self.provs):
            return  # nothing provisioned here (remote-only run)
        status = self.status()
        rows = status["workers"]
        state = {n: st for prov in self.provs for n, st in handle_states(prov, rows).items()}
        released = 0
        for k, prov in enumerate(self.provs):
            if self.cfg.activation:
                keep = {h.name for h in prov.alive() if state.get(h.name) != "standby"}
                r = reconcile(prov, keep, rows, reason="activation")
                released += len(r.stopped)
                self.released += len(r.stopped)
            else:
                r = reconcile(prov, len(prov.alive()), rows, reason="fleet")
            for h in r.dead:
                log.warning(
                    "worker %s died (exit code %s); %s (log %s)",
                    h.name,
                    h.exit_code,
                    "replaced" if r.started else "not replaced",
                    self._log_path(h.name),
                )
            self.replaced += len(r.started)
            self._crash_loop(k, r.dead, now)
        released += self._release_too_slow(state, now)
        # Not in a pass that released standby workers: the decision just found a surplus.
        if self.cfg.activation and not released:
            self._follow_short(status, state, now)

    def _release_too_slow(self, state: dict, now: float) -> int:
        """Release provisioned workers refused as too slow for `standby_release_s`."""
        for name, seen in state.items():
            if seen == "too_slow":
                self._slow.setdefault(name, [now, now])[1] = now
        for name in [
            n for n, (_, last) in self._slow.items() if now - last > 3 * self.cfg.period_s
        ]:
            del self._slow[name]  # not refused for three passes: it is useful again
        stopped = 0
        for prov in self.provs:
            for h in prov.alive():
                if state.get(h.name) != "too_slow" or h.name not in self._slow:
                    continue
                idle = now - self._slow[h.name][0]
                if idle < self.cfg.standby_release_s:
                    continue
                usd = h.price_per_hour * idle / 3600.0
                prov.stop(h, "too slow: standby", idle_s=idle, idle_usd=usd)
                del self._slow[h.name]
                log.info(
                    "fleet: released worker %s ($%.2f/h): refused as too slow for %.0fs, "
                    "$%.4f paid for no work (a larger staleness would let it help)",
                    h.name,
                    h.price_per_hour,
                    idle,
                    usd,
                    extra={"console": True},
                )
                stopped += 1
                self.slow_released += 1
                self.slow_idle_s += idle
                self.slow_idle_usd += usd
        self.released += stopped
        return stopped

    def _crash_loop(self, k: int, dead, now: float) -> None:
        deaths = self._deaths[k]
        deaths.extend((now, h) for h in dead if h.exit_code is not None)
        while deaths and now - deaths[0][0] > self.cfg.death_window_s:
            deaths.popleft()
        if len(deaths) >= self.cfg.max_deaths:
            h = deaths[-1][1]
            raise RuntimeError(
                f"rollout workers keep dying ({len(deaths)} within "
                f"{self.cfg.death_window_s:.0f}s, last {h.name} with exit code {h.exit_code}): "
                f"see {self._log_path(h.name)}"
            )

    def _follow_short(self, status: dict, state: dict, now: float) -> None:
        # The rate only: `capacity/warning` also fires on freshness (latency vs staleness),
        # which more workers do not fix; starting on it undid standby releases in the demo.
        required = status.get("capacity/required_rollouts_per_s")
        active = status.get("capacity/active_rollouts_per_s")
        # Only on a confident prediction (warm measurements, fleet_plan.py): a cold T (the
        # first update's compile) or a cold first lease says nothing about the steady state.
        confident = status.get("capacity/confident", 1)
        short = confident and required is not None and active is not None and required > active
        if not short or now - self._last_short < self.cfg.short_cooldown_s:
            return
        alive = [h for p in self.provs for h in p.alive()]
        if any(state.get(h.name) is None for h in alive):
            return  # a started worker has not joined yet: it may be what is missing
        spend = sum(h.price_per_hour for h in alive)
        for prov in sorted(self.provs, key=lambda p: p.price_per_hour):
            fits = spend + prov.price_per_hour <= self.cfg.max_usd_per_hour + 1e-9
            if len(alive) < self.cfg.max_workers and fits and prov.room() > 0:
                why = (
                    f"activation: short (required {required or 0:.2f} rollouts/s, "
                    f"active {active or 0:.2f})"
                )
                self.added += len(prov.start(1, why))
                self._last_short = now
                return

    def close(self, reason: str = "learner shutting down") -> None:
        """Stop every provisioned worker and wait for local processes to exit."""
        for prov in self.provs:
            prov.stop_all(reason)
        for prov in self.provs:
            if hasattr(prov, "wait"):
                prov.wait(self.cfg.wait_s)
