"""Leasing: whether a worker that asks for work gets some, how much, and the lease itself.

`Leasing` is a part of `Controller` (bridge/control/controller.py), built from the database,
the config, the clock, the lease timing (the too-slow rule, lease_timing.py), the prompt
stream and the lease content. It never references the controller; the caller holds the
controller's lock and transaction and has already answered the reasons that do not depend
on the worker's version (run over, nothing published, inactive).

Admission (the rule and its derivation: bridge/contracts/staleness.py): a lease at version
x may bring leased + buffered groups up to `admission_capacity(x, t, S, g)`, x being the
worker's version, at most the newest published P; with no room the answer is "full", and the
idle fleet's asks are spread to a fleet-wide budget (refusal_pacing.py). A worker more than m
(`max_version_lag`) versions behind P gets no work, only `swap_to` (reason "behind"),
except one fetching P in the background (peer broadcast, `fetching_version`) or unable to
load it (`unloadable_version`), which works one version behind: the broadcast overlaps
generation instead of idling the worker (the planner's "held" admission). A worker whose
last lease came back stale and whose measured lease latency exceeds the time left before
new work would go stale gets no work either ("too_slow", lease_timing.py), except with partial
rollouts (`partial="continue"`: its lease is continued under the newer versions). Then at most
`max_leases_per_worker` active leases ("lease_limit") and the worker's concurrency as
measured (its declared one only an upper bound; lease_caps.py). Heartbeats renew leases
up to an absolute age cap from the measured latency (`renew`, lease_caps.py). Drops stay
possible (a worker slowing down mid-lease, restarts) and are counted, never fed to the
learner. A group dropped as stale is not leased back to the worker that returned it late while
another worker asks for work (`_groups_for`).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import NamedTuple

from bridge.contracts import staleness as staleness_rule
from bridge.control.config import ControllerConfig
from bridge.control.leasing import lease_caps
from bridge.control.leasing.lease_content import LeaseContent
from bridge.control.leasing.lease_timing import LeaseTiming
from bridge.control.leasing.prompt_stream import PromptStream
from bridge.control.leasing.refusal_pacing import RefusalPacing
from bridge.control.protocol import Lease, LeaseRequest, WorkerProfile
from bridge.control.state.db import ControllerDB


class Grant(NamedTuple):
    """A lease written under the lock: its id, deadline and its groups' rows."""

    lease_id: str
    expires_at: float
    rows: list[dict]


class Leasing:
    def __init__(
        self,
        db: ControllerDB,
        config: ControllerConfig,
        clock: Callable[[], float],
        timing: LeaseTiming,
        prompts: PromptStream,
        content: LeaseContent,
        held_back: Callable[[str, float], None] = lambda worker_id, now: None,
    ):
        """`held_back(worker_id, now)`: told when work is refused for the controller's own
        reasons (admission full, too slow), which are not the worker's slowness
        (FleetPlan.held_back, its measured rate)."""
        self.db, self.config, self.clock = db, config, clock
        self.held_back = held_back
        self.timing, self.prompts, self.content_of = timing, prompts, content
        self.pacing = RefusalPacing(config)  # when a worker refused as "full" asks again
        # (worker_id, when) of the last worker that asked for work, and of the last other
        # one before it: whether someone else is around to take a group (`_groups_for`).
        self._last_asker = self._other_asker = ("", float("-inf"))

    def capacity(self, version: int, newest: int) -> int:
        """How many groups may be leased + buffered now for a lease generated at `version`
        (at most `newest`, the newest published) and still be fresh when consumed."""
        if newest < 0:
            return 0
        next_step = self.db.get("next_step", 0)
        c = self.config
        return staleness_rule.admission_capacity(
            min(version, newest), next_step, c.staleness, c.groups_per_step
        )

    def room(self, version: int, newest: int) -> int:
        """Groups a lease at `version` may still add to the leased + buffered ones."""
        return self.capacity(version, newest) - self.db.count("leased", "buffered")

    def behind(self, worker_id: str, req: LeaseRequest, newest: int) -> bool:
        """More than `max_version_lag` versions behind the newest. A newest version the
        worker is fetching in the background (a relay hop, a WAN download) does not count:
        it keeps generating on its own version meanwhile, admitted at that version. Nor does
        one it could not load (corrupt in the store: a worker verifies every chunk): it keeps
        generating until the learner publishes it again (liveness.py) or the next one.
        Without this one corrupt version stalled the learner: every worker was refused work
        for being behind."""
        lag = newest - req.worker_version
        if req.fetching_version == newest >= 0:
            lag -= 1
        elif req.unloadable_version == newest >= 0:  # logged by liveness.py
            lag -= 1
        return lag > self.config.max_version_lag

    def offer(
        self, worker_id: str, req: LeaseRequest, newest: int, profile: WorkerProfile
    ) -> tuple[Grant | None, str, float]:
        """(grant, "", 0) or (None, reason, retry_after_s) for a worker's lease request. The
        grant is written; its content (`content`) is built by the caller after the lock."""
        c, now = self.config, self.clock()
        if self._last_asker[0] != worker_id:
            self._other_asker = self._last_asker
        self._last_asker = (worker_id, now)
        if self.behind(worker_id, req, newest):
            return None, "behind", 0.0
        # Its active leases from memory (db_leases.py keeps every one), not the table.
        if len(self.db.deadlines.active(worker_id)) >= c.max_leases_per_worker > 0:
            return None, "lease_limit", c.retry_after_s
        version, step = min(req.worker_version, newest), self.db.get("next_step", 0)
        room = self.room(version, newest)
        if room <= 0:  # nobody is admitted before the next batch: the asks spread out
            self.held_back(worker_id, now)
            return None, "full", self.pacing.full_retry_s(worker_id, now)
        # Only a worker that may be admitted reads what it holds: most asks of a large
        # fleet are refused as "full" above, with two reads of one small table.
        measured = self.db.fleet_row(worker_id)  # accepted rollouts/s, not its declaration
        worker_room = lease_caps.max_groups_held(
            profile.max_concurrent_sequences,
            measured["rollouts_per_s"] if measured is not None else None,
            group_size=c.group_size,
            lease_ttl_s=c.lease_ttl_s,
            max_groups_per_lease=c.max_groups_per_lease,
        ) - self.db.groups_held(worker_id)
        k = min(req.max_groups, c.max_groups_per_lease, room, worker_room)
        if k <= 0:  # this worker holds all it may: room opens when it submits
            return None, "full", c.retry_after_s
        # With partial rollouts a slow worker's lease is continued under each newer version
        # instead of coming back too stale: its capacity is used, not refused.
        if c.partial != "continue" and not self.timing.admit(
            worker_id, version, step, now, profile.price_per_hour
        ):
            self.held_back(worker_id, now)
            # 2000 refused workers asking every retry_after_s were 290 leases/s of load.
            return None, "too_slow", max(c.retry_after_s, self.timing.until_next_batch_s(now))
        self.pacing.admitted(worker_id)
        rows = self._groups_for(worker_id, k, now)
        lease_id, expires = uuid.uuid4().hex, now + c.lease_ttl_s
        self.db.add_lease(lease_id, worker_id, now, expires)
        # No token of this lease may carry an older version (validation.py): a worker's
        # versions only go up, so an older tag is one the lease did not give.
        self.db.put(f"lease_version/{lease_id}", version)
        self.db.set_state([r["group_id"] for r in rows], "leased", lease_id=lease_id)
        self.db.incr("leases/issued")
        return Grant(lease_id, expires, [dict(r) for r in rows]), "", 0.0

    def content(self, grant: Grant) -> Lease:
        """What the worker gets for `grant`: each group's prompt ids (the tokenizer), its
        sampling seed (an HMAC) and the protocol models. It reads only the granted rows and
        the config, so it runs outside the controller's lock (it was ~15% of a grant's
        time under it)."""
        groups = [self.content_of.group(r, grant.lease_id) for r in grant.rows]
        return Lease(
            lease_id=grant.lease_id,
            expires_at=grant.expires_at,
            groups=groups,
            partial=self.config.partial,
        )

    def renew(self, worker_id: str, now: float) -> list[str]:
        """A heartbeat: renew `worker_id`'s active leases by `lease_ttl_s`, except those past
        their deadline or their absolute age cap (lease_caps.py), which the next sweep
        expires (their groups requeue); returns the renewed lease ids. In memory only
        (db_leases.py): no SQLite, no controller lock."""
        c, lat = self.config, self.timing.latency.get(worker_id)
        cap = lease_caps.max_lease_age_s(lat.seconds if lat is not None else None, c.lease_ttl_s)
        return self.db.deadlines.renew(worker_id, now, now + c.lease_ttl_s, cap)

    def _groups_for(self, worker_id: str, k: int, now: float) -> list:
        """The first `k` queued groups, less those `worker_id` returned too stale while
        another worker asked for work within a lease's TTL: a dropped group requeues at the
        front, and the late worker, asking again at once, took it again and again (the same
        prompts dropped ten times, never trained). It waits for another worker instead; a
        worker alone still gets it back."""
        other, asked_at = self._other_asker
        others = other not in ("", worker_id) and now - asked_at <= self.config.lease_ttl_s
        self._refill(k)
        if not others:
            return self.db.groups_in("queued", k)
        rows = self.db.queued_not_dropped_by(worker_id, k)
        if len(rows) < k:  # the ones it skipped count against the queue: draw more
            self._refill(k + self.db.count("queued") - len(rows))
            rows = self.db.queued_not_dropped_by(worker_id, k)
        return rows

    def _refill(self, k: int) -> None:
        short = k - self.db.count("queued")
        if short > 0:
            new = self.prompts.draw(short)
            self.db.add_groups([(p.prompt_id, p.text, p.answer) for p in new])
