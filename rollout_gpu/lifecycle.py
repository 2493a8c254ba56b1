"""A rollout worker's life beside its work: contact with the controller, what the controller
says it should be doing (active, standby, run over), and how it stops.

- `Contact`: when the controller last answered. Losing it logs one line, regaining it
  another (plus a reminder every `remind_s`), never one per retry; after
  `max_no_contact_s` without an answer `check()` raises `ControllerGone` and the worker
  exits non-zero (leases it held expire at the controller; nothing half-done is sent).
- `backoff_delay`: capped exponential backoff with full-range jitter, so a fleet whose
  controller restarts does not come back in lockstep.
- `Standing`: the controller's word from heartbeats and leases: `active` (false = standby:
  lease nothing, idle until a heartbeat says active again) and `run_over` (training ended:
  leave and exit 0). One log line per change.
- `install_stop_signals`: the first SIGTERM/SIGINT asks the worker to stop (finish or
  release the current lease within the grace time) and arms a watchdog that ends the
  process `grace_s + margin_s` later whatever it is blocked on (a hung HTTP call to a
  vanished host); a second signal ends it at once.
- `stop_when_parent_exits`: a local worker of a training binary that died (even by kill -9,
  when nothing tells its children) stops as on SIGTERM instead of serving nobody for
  `max_no_contact_s`.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable

from absl import logging

EXIT_NO_CONTACT = 3  # exit status after max_no_contact_s without the controller


class ControllerGone(ConnectionError):
    """No answer from the controller for longer than the worker's no-contact limit."""


def backoff_delay(attempt: int, base_s: float, cap_s: float) -> float:
    """Seconds before retry `attempt` (0-based): base * 2^attempt, capped, jittered to
    [50%, 100%] of that."""
    return min(cap_s, base_s * 2 ** min(attempt, 30)) * random.uniform(0.5, 1.0)


class Contact:
    def __init__(
        self,
        controller: str,
        max_no_contact_s: float,
        remind_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.controller, self.max_no_contact_s = controller, max_no_contact_s
        self.remind_s, self.clock = remind_s, clock
        self.last_ok = clock()
        self.lost = False
        self._reminded = 0.0
        self._lock = threading.Lock()

    def ok(self) -> None:
        """The controller answered (any HTTP status below 500)."""
        with self._lock:
            now = self.clock()
            if self.lost:
                self.lost = False
                logging.warning(
                    "controller %s answers again (after %.0fs without contact)",
                    self.controller,
                    now - self.last_ok,
                )
            self.last_ok = now

    def failed(self, why: str) -> None:
        """An attempt got no answer (connection error, timeout, 5xx)."""
        with self._lock:
            now = self.clock()
            if not self.lost:
                self.lost, self._reminded = True, now
                logging.warning(
                    "controller %s unreachable (%s); retrying with backoff, giving up after "
                    "%.0fs without contact",
                    self.controller,
                    why,
                    self.max_no_contact_s,
                )
            elif now - self._reminded >= self.remind_s:
                self._reminded = now
                logging.warning(
                    "still no contact with %s for %.0fs (%s)",
                    self.controller,
                    now - self.last_ok,
                    why,
                )

    def silent_s(self) -> float:
        return self.clock() - self.last_ok

    def left_s(self) -> float:
        """Seconds until the no-contact limit."""
        return max(0.0, self.max_no_contact_s - self.silent_s())

    def expired(self) -> bool:
        return self.lost and self.silent_s() >= self.max_no_contact_s

    def check(self) -> None:
        if self.expired():
            raise ControllerGone(
                f"no contact with the controller {self.controller} for "
                f"{self.silent_s():.0f}s (--max_no_contact_s={self.max_no_contact_s:g}); giving up"
            )


class Standing:
    """What the controller last told this worker; `changed` is set on every change."""

    def __init__(self, on_run_over: Callable[[], None] = lambda: None):
        self.active = True
        self.run_over = False
        self.changed = threading.Event()
        self._on_run_over = on_run_over
        self._lock = threading.Lock()

    def update(self, active: bool | None = None, run_over: bool = False) -> None:
        with self._lock:
            if run_over and not self.run_over:
                self.run_over = True
                logging.info("the run is over (the controller says so): leaving, exit 0")
                self._on_run_over()
                self.changed.set()
            if active is not None and active != self.active and not self.run_over:
                self.active = active
                logging.info(
                    "%s",
                    "active again: taking leases"
                    if active
                    else "on standby (the fleet does not need this worker now): no leases, "
                    "heartbeats only",
                )
                self.changed.set()


def install_stop_signals(
    request_stop: Callable[[], None], grace_s: float, margin_s: float = 3.0
) -> None:
    """SIGTERM/SIGINT: first -> `request_stop()` + a watchdog at grace_s + margin_s;
    second -> exit now (status 128 + signal)."""
    stopping = threading.Event()

    def watchdog() -> None:
        time.sleep(grace_s + margin_s)
        logging.error("still running %.0fs after the stop request: exiting now", grace_s + margin_s)
        logging.flush()
        os._exit(1)

    def handler(signum, frame) -> None:
        del frame
        if stopping.is_set():
            logging.warning("second %s: exiting now", signal.Signals(signum).name)
            logging.flush()
            os._exit(128 + signum)
        stopping.set()
        threading.Thread(target=watchdog, daemon=True, name="stop-watchdog").start()
        request_stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def stop_when_parent_exits(parent_pid: int, period_s: float = 1.0) -> None:
    """SIGTERM to this process (the stop path above) once its parent is gone: an orphan is
    re-parented, so `os.getppid()` stops being `parent_pid`."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(period_s)
        logging.warning(
            "the process that started this worker (pid %d) is gone: stopping", parent_pid
        )
        os.kill(os.getpid(), signal.SIGTERM)

    if parent_pid > 1:  # already orphaned at start: nothing to watch
        threading.Thread(target=watch, daemon=True, name="parent-watch").start()
