"""Discrete-event simulation (simpy) of one ECHO-2 run: learner, rollout fleet, broadcast.

Versions as in the code base: version v = params after v updates; learner step t trains
on a batch of G = ceil(R / group_size) groups, each generated with a version fresh at t
(bridge/contracts/staleness.py; older buffered groups are dropped and counted, as
`LearnerSide.drop_stale` does), taken
oldest version first, then by arrival. Each update takes step_s; after update v, if
v % kappa == 0, version v is published publish_s later (off the learner's critical path:
the learner keeps training while it is written) and then broadcast to the workers that
are up. A new round starts once the previous one has left the broadcast's bottleneck
(links.period); versions published meanwhile are skipped in favour of the newest (relays
keep few versions). Delays per worker come from links.py.

A worker runs `slots` leases at once, each one group taking lease_dur = group_size * slots
/ mu on average (uniform jitter of +-lease_jitter, default 25%: response lengths vary, and
without it every worker runs in lock-step with the learner, a phase-locking no real fleet
shows), generated with the version it held at lease start. Admission, checked at every lease
request with t = the learner's next step:
- "held" (default): leased + buffered below `staleness.admission_capacity` at the worker's
  own version x: the controller's bound applied to the version the rollout will carry, so a
  worker keeps working on its old version while a broadcast is in flight, exactly what the
  capacity model assumes. The controller does this for a worker whose relay fetches the
  newest version in the background (`bridge.broadcast` chain/tree, LeaseRequest.fetching_version);
- "controller": a worker more than m = max_version_lag behind the newest published P gets
  no work until its download ends, and leased + buffered below the capacity at P - m: what
  the controller does for a worker reading the store directly (`store` broadcast), whose
  download is its swap.
Preemptions are a Poisson process per worker: leases in flight are lost, the worker is back
restart_s later and first fetches the newest version alone (links.single_fetch_s).

Left out: lease timeouts, the controller's "too_slow" rule, heartbeats, the cost of swapping
weights into vLLM (fold it into the broadcast delay).
"""

from __future__ import annotations

import collections
import dataclasses
import math

import numpy as np
import simpy

from bridge.contracts import staleness as staleness_rule
from bridge.plan import links


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """One active worker instance."""

    wid: str
    type_name: str
    rollouts_per_s: float
    bandwidth_mb_s: float
    preempt_per_hour: float
    lease_s: float  # 0: one lease at a time
    restart_s: float


@dataclasses.dataclass(frozen=True)
class SimConfig:
    step_s: float
    rollouts_per_step: int
    publish_s: float
    model_bytes: float
    staleness: int
    publish_every: int
    steps: int
    broadcast: str = "store"
    uplink_mb_s: float = math.inf
    chunk_mb: float = 64.0
    fanout: int = 4
    group_size: int = 8
    admission: str = "held"
    version_bytes: float | None = None  # one new version on the wire (None: model_bytes)
    max_version_lag: int = 0
    lease_jitter: float = 0.25  # lease time ~ U[1 - j, 1 + j] * lease_dur
    seed: int = 0


def slots_and_lease(w: WorkerSpec, group_size: int) -> tuple[int, float]:
    """Concurrent leases and seconds per lease, so that the worker makes mu rollouts/s."""
    slots = max(1, round(w.rollouts_per_s * w.lease_s / group_size))
    return slots, group_size * slots / w.rollouts_per_s


@dataclasses.dataclass
class _Worker:
    spec: WorkerSpec
    slots: int
    lease_dur: float
    up_event: simpy.Event
    changed: simpy.Event  # its version moved
    version: int = 0
    up: bool = True
    incarnation: int = 0
    procs: list = dataclasses.field(default_factory=list)
    gen_s: float = 0.0  # slot-seconds spent generating leases that completed


class Simulation:
    def __init__(self, cfg: SimConfig, workers: list[WorkerSpec]):
        self.cfg, self.env = cfg, simpy.Environment()
        self.rng = np.random.default_rng(cfg.seed)
        self.groups_per_step = math.ceil(cfg.rollouts_per_step / cfg.group_size)
        self.buffer: list[tuple[int, float]] = []  # (version, arrival) per group
        self.leased = 0
        self.next_step = 0
        self.newest = 0  # P
        self.published_at = {0: 0.0}
        self.room = self.env.event()  # admission room may have grown
        self.arrived = self.env.event()  # a group reached the buffer
        self.published = self.env.event()
        self.hist: collections.Counter = collections.Counter()
        self.dropped = self.lost = self.preemptions = 0
        self.bcast: list[float] = []  # publish -> delivery, per worker per round
        self.wait_start: list[float] = []
        self.train_start: list[float] = []
        self.workers = []
        for spec in workers:
            slots, dur = slots_and_lease(spec, cfg.group_size)
            self.workers.append(
                _Worker(spec, slots, dur, self.env.event(), self.env.event(), version=0)
            )

    # -- events ---------------------------------------------------------------------------
    def _fire(self, name: str) -> None:
        ev = getattr(self, name)
        setattr(self, name, self.env.event())
        ev.succeed()

    def _fire_worker(self, w: _Worker, name: str) -> None:
        ev = getattr(w, name)
        setattr(w, name, self.env.event())
        ev.succeed()

    # -- learner --------------------------------------------------------------------------
    def _drop_stale(self, step: int) -> None:
        keep = [g for g in self.buffer if staleness_rule.is_fresh(g[0], step, self.cfg.staleness)]
        if len(keep) < len(self.buffer):
            self.dropped += len(self.buffer) - len(keep)
            self.buffer = keep
            self._fire("room")

    def learner(self):
        c, g = self.cfg, self.groups_per_step
        for t in range(c.steps):
            self.next_step = t
            self.wait_start.append(self.env.now)
            self._fire("room")  # next_step moved
            while True:
                self._drop_stale(t)
                if len(self.buffer) >= g:
                    break
                yield self.arrived
            self.buffer.sort()
            batch, self.buffer = self.buffer[:g], self.buffer[g:]
            for version, _ in batch:
                self.hist[t - version] += 1
            self.next_step = t + 1
            self._fire("room")
            self.train_start.append(self.env.now)
            yield self.env.timeout(c.step_s)
            if (t + 1) % c.publish_every == 0:
                self.env.process(self.publish(t + 1))
        self.end = self.env.now

    def publish(self, version: int):
        yield self.env.timeout(self.cfg.publish_s)
        if version > self.newest:
            self.newest = version
            self.published_at[version] = self.env.now
            self._fire("room")
            self._fire("published")

    def broadcaster(self):
        c, done = self.cfg, 0
        while True:
            while self.newest <= done:
                yield self.published
            done = version = self.newest
            ups = [w for w in self.workers if w.up]
            wire = c.model_bytes if c.version_bytes is None else c.version_bytes
            ds = links.delays(
                c.broadcast,
                wire,
                [w.spec.bandwidth_mb_s for w in ups],
                c.uplink_mb_s,
                c.chunk_mb,
                c.fanout,
            )
            for w, d in zip(ups, ds, strict=True):
                self.env.process(self.deliver(w, version, d, w.incarnation))
            bw = [w.spec.bandwidth_mb_s for w in ups]
            yield self.env.timeout(links.period(c.broadcast, wire, bw, c.uplink_mb_s, c.fanout, ds))

    def deliver(self, w: _Worker, version: int, delay: float, incarnation: int):
        yield self.env.timeout(delay)
        if w.incarnation == incarnation and w.version < version:
            w.version = version
            self.bcast.append(self.env.now - self.published_at[version])
            self._fire_worker(w, "changed")

    # -- workers --------------------------------------------------------------------------
    def _admit(self, x: int) -> bool:
        c, held = self.cfg, self.leased + len(self.buffer)
        if c.admission == "controller":
            if self.newest - x > c.max_version_lag:
                return False
            x = self.newest - c.max_version_lag  # the conservative bound of any lag <= m
        return staleness_rule.admits(held, x, self.next_step, c.staleness, self.groups_per_step)

    def slot(self, w: _Worker):
        while True:
            in_lease = False
            try:
                if not w.up:
                    yield w.up_event
                    continue
                self._drop_stale(self.next_step)
                x = w.version
                if not self._admit(x):
                    yield self.room | w.changed
                    continue
                self.leased += 1
                in_lease = True
                j = self.cfg.lease_jitter
                dur = w.lease_dur * self.rng.uniform(1.0 - j, 1.0 + j)
                yield self.env.timeout(dur)
                self.leased -= 1
                in_lease = False
                w.gen_s += dur
                self.buffer.append((x, self.env.now))
                self._fire("arrived")
            except simpy.Interrupt:
                if in_lease:  # the lease is lost; its prompts go back to the queue
                    self.leased -= 1
                    self.lost += 1
                    self._fire("room")

    def preempter(self, w: _Worker):
        rate = w.spec.preempt_per_hour / 3600.0
        if rate <= 0:
            return
        c = self.cfg
        while True:
            yield self.env.timeout(self.rng.exponential(1.0 / rate))
            self.preemptions += 1
            w.up = False
            w.incarnation += 1
            for p in w.procs:
                p.interrupt()
            yield self.env.timeout(w.spec.restart_s)
            version = self.newest
            yield self.env.timeout(
                links.single_fetch_s(
                    c.broadcast, c.model_bytes, w.spec.bandwidth_mb_s, c.uplink_mb_s
                )
            )
            w.version, w.up = version, True
            self._fire_worker(w, "up_event")
            self._fire_worker(w, "changed")

    # -- run ------------------------------------------------------------------------------
    def run(self) -> dict:
        learner = self.env.process(self.learner())
        self.env.process(self.broadcaster())
        for w in self.workers:
            w.procs = [self.env.process(self.slot(w)) for _ in range(w.slots)]
            self.env.process(self.preempter(w))
        self.env.run(until=learner)
        return self.result()

    def result(self) -> dict:
        c, g = self.cfg, self.cfg.group_size
        wall = self.end
        # Steady state: skip the first tenth of the steps (fleet warm-up, first batch).
        k0 = c.steps // 10
        window = wall - self.wait_start[k0]
        steady = (c.steps - k0) * c.step_s / window if window > 0 else 1.0
        waits = [s - w for s, w in zip(self.train_start, self.wait_start, strict=True)]
        slot_s = sum(w.slots for w in self.workers) * wall
        return {
            "wall_s": wall,
            "busy_s": c.steps * c.step_s,
            "utilization": c.steps * c.step_s / wall if wall > 0 else 1.0,
            "steady_utilization": min(1.0, steady),
            "staleness_histogram": {str(k): v * g for k, v in sorted(self.hist.items())},
            "staleness_mean": (
                sum(k * v for k, v in self.hist.items()) / max(1, sum(self.hist.values()))
            ),
            "dropped_rollouts": self.dropped * g,
            "lost_rollouts": self.lost * g,
            "preemptions": self.preemptions,
            "wait_s_mean": float(np.mean(waits)),
            "wait_s_max": float(np.max(waits)),
            "stalled_steps": int(sum(w > 1e-6 for w in waits[k0:])),
            "broadcast_s_mean": float(np.mean(self.bcast)) if self.bcast else 0.0,
            "broadcast_s_max": float(np.max(self.bcast)) if self.bcast else 0.0,
            "fleet_generating_fraction": (
                sum(w.gen_s for w in self.workers) / slot_s if slot_s else 0.0
            ),
        }


def simulate(cfg: SimConfig, workers: list[WorkerSpec]) -> dict:
    """Run the simulation to the end of the learner's last step; a dict of measurements."""
    if not workers:
        raise ValueError("no active workers: the learner would wait forever")
    return Simulation(cfg, workers).run()
