"""The interface through which the learner starts and releases rollout workers.

A `Provisioner` starts workers (`start(n, reason)`), releases one (`stop(handle, reason)`),
lists the ones it believes alive (`alive()`) and reports those that died since the last
look (`poll()`). Implementations supply `_launch`, `_release` and `_exit_code`:
bridge/fleet/local.py (processes on this machine) and bridge/fleet/command.py (user
command templates, so any cloud CLI plugs in). bridge/fleet/reconcile.py drives them.

Limits are checked before anything is started: at most `max_workers` alive, and the
hourly price of the alive ones plus the new ones (each at the declared `price_per_hour`)
at most `max_usd_per_hour`; what does not fit is refused and logged, never started.

Every start, stop, death and refusal is one JSON line in `<workdir>/provisioner.jsonl`
(time, event, worker name, reason, price per hour, cost so far), so the spend can be
audited after the run. Names are `<prefix><n>`, n counting on from the log's last start,
so a restarted learner never reuses a name.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import math
import os
import threading
import time
from typing import Any

from bridge.control.trust.identity import mint_credential


@dataclasses.dataclass
class WorkerHandle:
    """One worker a provisioner started; `info` is the implementation's own (pid, log)."""

    name: str
    price_per_hour: float
    started_at: float  # wall clock
    reason: str
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    stopped_at: float | None = None
    exit_code: int | None = None  # once it died on its own

    @property
    def done(self) -> bool:
        return self.stopped_at is not None

    def cost_usd(self, now: float | None = None) -> float:
        end = self.stopped_at if self.stopped_at is not None else (now or time.time())
        return self.price_per_hour * max(0.0, end - self.started_at) / 3600.0


@dataclasses.dataclass(frozen=True)
class Limits:
    max_workers: int = 8
    max_usd_per_hour: float = math.inf


class ProvisionLog:
    """Append-only JSONL of provisioning events."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"t": time.time(), "event": event, **fields}, sort_keys=True)
        with self._lock, open(self.path, "a") as f:
            f.write(line + "\n")

    def read(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]


class Provisioner(abc.ABC):
    def __init__(
        self, workdir: str, price_per_hour: float, limits: Limits | None = None, prefix: str = "w"
    ):
        if price_per_hour < 0:
            raise ValueError(f"price_per_hour must be >= 0, got {price_per_hour}")
        self.workdir, self.price_per_hour = workdir, price_per_hour
        self.limits = limits or Limits()
        self.prefix = prefix
        self.log = ProvisionLog(os.path.join(workdir, "provisioner.jsonl"))
        self._next = sum(1 for e in self.log.read() if e["event"] == "start")
        self.handles: list[WorkerHandle] = []

    # -- implementations ---------------------------------------------------------------------
    @abc.abstractmethod
    def _launch(self, name: str) -> dict[str, Any]:
        """Start worker `name`; returns its `info`. Raises if it could not be started."""

    @abc.abstractmethod
    def _release(self, handle: WorkerHandle) -> None:
        """Ask worker `handle` to stop and give its machine back."""

    @abc.abstractmethod
    def _exit_code(self, handle: WorkerHandle) -> int | None:
        """None while the worker runs; its exit status once it is gone."""

    def identity(self, handle: WorkerHandle) -> str:
        """The identity the controller gives worker `handle` (bridge/control/trust/identity.py).
        The fleet follower takes a status row for this handle's only with it: a name is what
        a worker sends, an identity is what it proves. A remote worker presents its own
        credential (`credential_file`), which only the operator can mint."""
        return f"cred:{handle.name}"

    def credential_file(self, name: str, join_secret_file: str) -> str:
        """Mint worker `name`'s credential from the join secret into
        `<workdir>/credentials/<name>` (owner-only) and return its path: the remote machine
        gets that, never the secret, so it registers as `cred:<name>` and nobody else can."""
        with open(join_secret_file) as f:
            credential = mint_credential(f.read().strip(), name)
        folder = os.path.join(self.workdir, "credentials")
        os.makedirs(folder, mode=0o700, exist_ok=True)
        path = os.path.join(folder, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(credential + "\n")
        return path

    # -- interface -----------------------------------------------------------------------
    def room(self) -> int:
        """How many more workers the limits allow now."""
        alive = self.alive()
        n = self.limits.max_workers - len(alive)
        if self.price_per_hour > 0 and math.isfinite(self.limits.max_usd_per_hour):
            spend = sum(h.price_per_hour for h in alive)
            budget = self.limits.max_usd_per_hour - spend + 1e-9
            n = min(n, math.floor(budget / self.price_per_hour))
        return max(0, n)

    def start(self, n: int, reason: str) -> list[WorkerHandle]:
        """Start up to `n` workers within the limits; returns the started ones."""
        ok = min(n, self.room())
        if ok < n:
            lim = self.limits
            why = f"limits: {lim.max_workers} workers, ${lim.max_usd_per_hour}/h"
            self.log.write(
                "refused", count=n - ok, reason=reason, price_per_hour=self.price_per_hour, why=why
            )
        started = []
        for _ in range(ok):
            name = f"{self.prefix}{self._next}"
            self._next += 1
            info = self._launch(name)
            h = WorkerHandle(name, self.price_per_hour, time.time(), reason, info)
            self.handles.append(h)
            started.append(h)
            self.log.write(
                "start", name=name, reason=reason, price_per_hour=h.price_per_hour, **info
            )
        return started

    def stop(self, handle: WorkerHandle, reason: str, **fields: Any) -> None:
        """Release `handle`; `fields` go into its log line (e.g. the paid idle time)."""
        if handle.done:
            return
        self._release(handle)
        handle.stopped_at = time.time()
        self.log.write(
            "stop",
            name=handle.name,
            reason=reason,
            price_per_hour=handle.price_per_hour,
            cost_usd=handle.cost_usd(),
            **fields,
        )

    def alive(self) -> list[WorkerHandle]:
        return [h for h in self.handles if not h.done]

    def poll(self) -> list[WorkerHandle]:
        """The workers that died on their own since the last poll (logged, no longer alive)."""
        dead = []
        for h in self.alive():
            code = self._exit_code(h)
            if code is not None:
                h.exit_code, h.stopped_at = code, time.time()
                dead.append(h)
                self.log.write(
                    "dead",
                    name=h.name,
                    exit_code=code,
                    price_per_hour=h.price_per_hour,
                    cost_usd=h.cost_usd(),
                )
        return dead

    def stop_all(self, reason: str) -> None:
        for h in self.alive():
            self.stop(h, reason)

    def by_name(self, name: str) -> WorkerHandle | None:
        return next((h for h in self.handles if h.name == name), None)

    def spend_usd(self) -> float:
        """Cost of every worker this provisioner started, so far."""
        return sum(h.cost_usd() for h in self.handles)
