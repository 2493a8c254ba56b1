"""The worker registry: registration, tokens, liveness and billing of each worker.

`WorkerRegistry` is a part of `Controller` (bridge/control/controller.py), built from what
it needs: the database (the `workers` table, bridge/control/state/db.py), the controller config,
the clock and the fleet plan it reports billing and swaps to. It never references the
controller; the caller holds the controller's lock and transaction.

Tokens: a registration gets a random bearer token of which only the SHA-256 is stored; a
token dies `token_ttl_s` after its worker's last contact (limits.py) and a quarantine
revokes it (audit.py). Billing: time between two contacts counts when they are at most
`worker_timeout_s` apart (idle-but-alive workers are billed too). Identity: each
registration is bound to who presented it (bridge/control/trust/identity.py), so a quarantine
bars the credential (or remote host) from registering again.

Hot columns (last contact, billed seconds, reported version, gauges) and the token map
are in memory (`HotWorkers`, bridge/control/state/hot_state.py): `touch` and `authenticate` touch
no SQLite and need no controller lock; `persist` writes the changed rows.

Evidence: `count_hidden` keeps, per worker, how many accepted completions held a token the
reward cannot see (bridge/control/intake/rewards.py `ScoringText`; scored 0), with the run's total
in `reward/hidden_tokens`. It is evidence for the operator (`hidden_tokens(worker_id)`), not
a quarantine trigger: an honest untrained policy samples padded ids too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import uuid
from collections.abc import Callable

from bridge.control.config import ControllerConfig
from bridge.control.fleet.fleet_plan import FleetPlan
from bridge.control.intake.validation import SubmissionError
from bridge.control.protocol import WorkerProfile
from bridge.control.state.db import ControllerDB
from bridge.control.state.hot_state import HotWorkers
from bridge.control.trust import limits
from bridge.control.trust.identity import IdentityBook
from bridge.control.trust.log_text import log_safe


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class WorkerRegistry:
    def __init__(
        self,
        db: ControllerDB,
        config: ControllerConfig,
        clock: Callable[[], float],
        fleet: FleetPlan,
    ):
        self.db, self.config, self.clock, self.fleet = db, config, clock, fleet
        self.identities = IdentityBook(db)
        self.hot = HotWorkers()
        self.hot.load(db.workers())
        # Parsed profiles of live workers: a profile never changes after registration, and
        # every lease asks for one (a row, JSON and a model under the lock otherwise).
        self._profiles: dict[str, WorkerProfile] = {}

    def register(self, profile: WorkerProfile, identity: str | None = None) -> tuple[str, str]:
        """A new worker registered by `identity` (bridge/control/trust/identity.py); returns
        (worker_id, token). A quarantined identity is refused (403); a credential's previous
        registration leaves (one live worker per credential)."""
        if why := self.identities.refused(identity):
            raise SubmissionError(why, 403)
        # Its own words, shown in logs and the status table: one escaped line each.
        texts = ("accelerator", "region", "name")
        profile = profile.model_copy(update={k: log_safe(getattr(profile, k), 128) for k in texts})
        if why := self.identities.name_refused(profile.name, identity):
            raise SubmissionError(why, 409)
        now = self.clock()
        if why := self._too_many_live(identity, now):
            raise SubmissionError(why, 429)
        worker_id, token = f"w-{uuid.uuid4().hex[:12]}", secrets.token_urlsafe(32)
        self.db.add_worker(worker_id, hash_token(token), profile.model_dump_json(), now)
        self.hot.add(worker_id, hash_token(token), now)
        self._profiles[worker_id] = profile
        self.db.incr("workers/registered")
        previous = self.identities.bind(worker_id, identity)
        self.identities.bind_name(profile.name, identity)
        if previous and (row := self.db.worker(previous)) and row["left_at"] is None:
            logging.warning("worker %s supersedes %s (%s)", worker_id, previous, identity)
            self.leave(previous)
        return worker_id, token

    def _too_many_live(self, identity: str | None, now: float) -> str | None:
        """Why a remote host may not register one more worker (it has
        `max_live_workers_per_address` heard within `worker_timeout_s`), else None. A
        credential holds one live worker anyway (identity.py); `local` is the operator."""
        most = self.config.max_live_workers_per_address
        if most <= 0 or not identity or not identity.startswith("host:"):
            return None
        live = self.hot.live_versions(now - self.config.worker_timeout_s)
        n = sum(1 for w in self.identities.workers_of(identity) if w in live)
        if n < most:
            return None
        return (
            f"{identity} has {n} live workers (controller.max_live_workers_per_address); "
            "one must leave or go silent first"
        )

    def authenticate(self, token: str) -> str | None:
        row = self.hot.by_token(hash_token(token))  # in memory: no SQLite, no lock
        alive = row and limits.token_alive(row[1], self.clock(), self.config.token_ttl_s)
        return row[0] if alive else None

    def versions(self) -> list[dict]:
        """Every worker (also those that left): `worker_id`, `version` (the policy version
        it last reported, -1 before its first), `price_per_hour`, `registered_at`."""
        return [
            {
                "worker_id": w["worker_id"],
                "version": w["version"],
                "price_per_hour": json.loads(w["profile"])["price_per_hour"],
                "registered_at": w["registered_at"],
            }
            for w in self.db.workers()
        ]

    def profile(self, worker_id: str) -> WorkerProfile:
        profile = self._profiles.get(worker_id)
        if profile is None:  # registered before a restart, or gone (not kept: not live)
            profile = WorkerProfile(**json.loads(self.db.worker(worker_id)["profile"]))
            if self.hot.get(worker_id) is not None:
                self._profiles[worker_id] = profile
        return profile

    def version(self, worker_id: str) -> int:
        """The policy version `worker_id` last reported."""
        w = self.hot.get(worker_id)
        return w.version if w is not None else self.db.worker(worker_id)["version"]

    def touch(self, worker_id: str, version: int | None = None, **gauges) -> None:
        """A contact: bill the time since the last one, record a reported version and
        gauges. In memory (`persist` writes it); a new version reaches the fleet plan when
        the controller next holds its lock (`take_swaps`)."""
        now = self.clock()
        gap = self.hot.touch(worker_id, now, self.config.worker_timeout_s, version, **gauges)
        if gap is not None:
            self.fleet.accrue(worker_id, *gap)

    def persist(self, only: str | None = None) -> None:
        """Write the hot columns changed since the last call (of `only`, if given)."""
        self.db.conn.executemany(
            "UPDATE workers SET last_seen=?, active_s=?, version=?, samples_per_s=?,"
            " tokens_per_s=? WHERE worker_id=?",
            self.hot.take_dirty(only),
        )

    def drop(self, worker_id: str) -> None:
        """`worker_id` left or was quarantined: write its hot columns, then forget them."""
        self.persist(only=worker_id)
        self.hot.drop(worker_id)
        self._profiles.pop(worker_id, None)

    def reload(self) -> None:
        """Read the hot state back after the table changed under it (a rollback)."""
        self.hot.load(self.db.workers())

    def count_hidden(self, worker_id: str, n: int) -> None:
        """`n` more of `worker_id`'s accepted completions held a hidden token."""
        if n > 0:
            self.db.incr(f"hidden_tokens/{worker_id}", n)
            self.db.incr("reward/hidden_tokens", n)

    def hidden_tokens(self, worker_id: str) -> int:
        """How many of `worker_id`'s accepted completions held a hidden token."""
        return int(self.db.get(f"hidden_tokens/{worker_id}", 0))

    def set_enabled(self, worker_id: str, enabled: bool) -> None:
        self.db.update_worker(worker_id, enabled=int(enabled))
        self.hot.set_enabled(worker_id, enabled)

    def is_active(self, worker_id: str) -> bool:
        """Enabled (not switched off by hand) and not on standby (fleet_plan.py)."""
        w = self.hot.get(worker_id)  # in memory: a heartbeat asks
        return w is not None and w.enabled and self.fleet.is_active(worker_id)

    def live_versions(self, now: float) -> dict[str, int]:
        """worker id -> version of the workers heard within `worker_timeout_s` (not left,
        not quarantined): the others are dead to the eval board (eval_leases.py)."""
        return self.hot.live_versions(now - self.config.worker_timeout_s)

    def leave(self, worker_id: str) -> None:
        """The worker said goodbye: its leases end (their groups requeue)."""
        for lease_id in self.db.active_leases(worker_id):
            self.db.end_lease(lease_id, "released")
        self.touch(worker_id)
        self.db.update_worker(worker_id, left_at=self.clock())
        self.drop(worker_id)
