"""The rollout worker's side of its conversation with the controller.

`ControllerSession` registers (`join`), makes every call through `call` -- retried with
capped exponential backoff and jitter while the controller is unreachable (connection
error, 5xx), re-registering on a 401 (token revoked or expired, controller restarted with a fresh
database) -- heartbeats from a daemon thread at the controller's interval with tokens/s
and samples/s measured over a sliding window (heartbeats also renew the leases), and
holds the stop state a SIGTERM sets (`request_stop`, `past_grace`).

Outages (rollout_gpu/lifecycle.py): `contact` logs one line when the controller stops
answering and one when it answers again, not one per retry; past `max_no_contact_s` without
an answer calls raise `ControllerGone`. While stopping, no retry outlives the grace time.
`standing` holds what heartbeats and leases say: standby (`active=false`) or run over.

Version news (announcements, relay routes) from every reply goes to the worker's
`WeightVersions` (rollout_gpu/versions.py), its one owner; the session only carries it.
`rollout_gpu/worker.py: RolloutWorker` holds a session and drives the lease loop.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from absl import logging

from bridge.config.keys import SCHEMA
from bridge.control.http.client import ControllerClient, ControllerError
from bridge.control.protocol import Heartbeat, VersionAnnouncement, WorkerProfile
from bridge.control.trust.join_secret import read_secret
from rollout_gpu.lifecycle import Contact, Standing, backoff_delay
from rollout_gpu.versions import WeightVersions

T = TypeVar("T")


class FatalError(RuntimeError):
    """The controller refuses this worker for good (wrong join secret, bad profile)."""


@dataclasses.dataclass(frozen=True)
@SCHEMA.declared_fields
class WorkerOptions:
    """What the worker binary's flags say. Fields besides these are the flags declared in
    bridge/config/keys.py with WorkerOptions among their readers, at the flags' defaults:
    throttle_s, max_leases, grace_s, max_backoff_s, max_no_contact_s, on_standby,
    cache_dir, and the weight relay for peers (relay, relay_host, relay_port, relay_url,
    peer_min_bytes_per_s; rollout_gpu/peer_swap.py)."""

    controller: str
    join_secret: str
    profile: WorkerProfile
    backoff_s: float = 0.5
    rate_window_s: float = 60.0
    tls_verify: Any = True  # True, False or a CA bundle path
    token_file: str = ""  # re-read at each (re-)registration: follows a secret rotation

    def __post_init__(self):
        # The declared default (and a flag's value) may start with ~: no shell expands it.
        object.__setattr__(self, "cache_dir", os.path.expanduser(self.cache_dir))


class Throughput:
    """Generated tokens/s and samples/s over the last `window_s` seconds (idle time counts)."""

    def __init__(self, window_s: float, clock=time.monotonic):
        self.window_s, self.clock = window_s, clock
        self._start = clock()
        self._events: collections.deque = collections.deque()  # (t, tokens, samples)
        self._lock = threading.Lock()

    def add(self, tokens: int, samples: int) -> None:
        with self._lock:
            self._events.append((self.clock(), tokens, samples))

    def rates(self) -> tuple[float, float]:
        with self._lock:
            now = self.clock()
            while self._events and self._events[0][0] < now - self.window_s:
                self._events.popleft()
            span = max(min(self.window_s, now - self._start), 1e-6)
            tokens = sum(e[1] for e in self._events)
            samples = sum(e[2] for e in self._events)
            return tokens / span, samples / span


class ControllerSession:
    def __init__(self, options: WorkerOptions, versions: WeightVersions | None = None):
        """`versions`: where version news goes and what heartbeats report (the worker's)."""
        self.opts = options
        self.versions = versions if versions is not None else WeightVersions()
        self.meter = Throughput(options.rate_window_s)
        self.client: ControllerClient | None = None
        self.worker_id = ""
        self.heartbeat_interval_s = 5.0
        self.active_sequences = 0
        self.stop = threading.Event()  # set by request_stop (SIGTERM)
        self._stop_at: float | None = None
        self._join_lock = threading.Lock()
        self._hb_stop = threading.Event()
        self._hb_wake = threading.Event()  # ends the heartbeat thread's wait early
        self._hb_thread: threading.Thread | None = None
        self._news_wanted = False  # want_news
        self._holding = False  # a held heartbeat is in flight
        self._hold_from = 0.0  # monotonic time from which a held heartbeat may be sent
        self.contact = Contact(options.controller, options.max_no_contact_s)
        self.standing = Standing(on_run_over=self.stop.set)

    @property
    def announcement(self) -> VersionAnnouncement:
        return self.versions.announced

    def request_stop(self, *_) -> None:
        if self._stop_at is None:
            self._stop_at = time.monotonic()
            logging.info(
                "stop requested: finishing the current lease (grace %.0fs)", self.opts.grace_s
            )
        self.stop.set()

    def past_grace(self) -> bool:
        return self._stop_at is not None and time.monotonic() > self._stop_at + self.opts.grace_s

    # -- controller connection -------------------------------------------------------------
    def _backoff(self, attempt: int, why: str, patient: bool, until_stop: bool = False) -> bool:
        """Sleep before retry `attempt`; False when the caller should give up instead
        (`until_stop`: as soon as a stop is requested). Raises `ControllerGone` past the
        no-contact limit."""
        self.contact.failed(why)
        if self.past_grace() or (not patient and attempt >= 3):
            return False
        if until_stop and self.stop.is_set():
            return False
        self.contact.check()
        delay = backoff_delay(attempt, self.opts.backoff_s, self.opts.max_backoff_s)
        delay = min(delay, self.contact.left_s() + 0.1)  # wake up to give up on time
        if self._stop_at is not None:  # no retry outlives the grace time
            delay = min(delay, max(0.0, self._stop_at + self.opts.grace_s - time.monotonic()))
        if until_stop:
            self.stop.wait(delay)
        elif patient:  # even when stopping: a lease in flight still needs its submit
            end = time.monotonic() + delay
            # ... but a SIGTERM mid-sleep cuts it to the grace time (the watchdog's limit).
            if self.stop.wait(delay) and self._stop_at is not None:
                end = min(end, self._stop_at + self.opts.grace_s)
            time.sleep(max(0.0, end - time.monotonic()))
        else:
            self._hb_stop.wait(delay)
        return True

    def join(self, patient: bool = True) -> None:
        import httpx

        attempt = 0
        while True:
            try:
                client, reg = ControllerClient.join(
                    self.opts.controller,
                    self._join_secret(),
                    self.opts.profile,
                    verify=self.opts.tls_verify,
                )
                break
            except ControllerError as e:
                if e.status < 500:
                    raise FatalError(f"controller refused registration: {e}") from e
                why = str(e)
            except httpx.TransportError as e:
                why = f"{type(e).__name__}: {e}"
            if not self._backoff(attempt, why, patient):
                raise ConnectionError(f"could not join {self.opts.controller}: {why}")
            attempt += 1
        self.contact.ok()
        # The old client is not closed: the other thread may be mid-request on it.
        self.client = client
        self.worker_id = reg.worker_id
        self.heartbeat_interval_s = reg.heartbeat_interval_s
        self.versions.reset(reg.announcement)
        logging.info(
            "joined %s as %s (heartbeat %.1fs, lease ttl %.1fs, newest version %d)",
            self.opts.controller,
            reg.worker_id,
            reg.heartbeat_interval_s,
            reg.lease_ttl_s,
            reg.announcement.version,
        )

    def _join_secret(self) -> str:
        # The controller may have rotated the secret (bridge/control/trust/join_secret.py) since
        # this worker started; an unreadable file falls back to the one given at start.
        if self.opts.token_file:
            try:
                return read_secret(self.opts.token_file)
            except (OSError, ValueError):
                pass
        return self.opts.join_secret

    def call(
        self,
        request: Callable[..., T],
        *args,
        patient: bool = True,
        until_stop: bool = False,
    ) -> T:
        """`request(client, *args)` on the current client, `request` a `ControllerClient`
        method (`session.call(ControllerClient.lease, req)`), retried through outages and
        re-registering on a 401; `until_stop`: give up once a stop is requested (work not
        yet started: a lease)."""
        import httpx

        method = request.__name__
        attempt = 0
        while True:
            client = self.client
            try:
                out = request(client, *args)
                self.contact.ok()
                return out
            except ControllerError as e:
                if e.status < 500:
                    self.contact.ok()  # it answered, if only to refuse
                if e.status == 401:
                    logging.warning("token rejected on %s; registering again", method)
                    with self._join_lock:
                        if self.client is client:  # the other thread may have rejoined already
                            self.join(patient)
                    continue
                if e.status < 500:
                    raise
                why = str(e)
            except httpx.TransportError as e:
                why = f"{type(e).__name__}: {e}"
            if not self._backoff(attempt, f"{method} failed ({why})", patient, until_stop):
                raise ConnectionError(f"{method}: controller unreachable ({why})")
            attempt += 1

    # -- heartbeats ------------------------------------------------------------------------
    def heartbeat_once(self, news_after: float | None = None) -> None:
        """One heartbeat; with `news_after` (a `published_at`), one the controller holds until
        a version published after it is announced (`want_news`)."""
        tokens_per_s, samples_per_s = self.meter.rates()
        hb = Heartbeat(
            worker_version=self.versions.loaded,
            samples_per_s=samples_per_s,
            tokens_per_s=tokens_per_s,
            active_sequences=self.active_sequences,
            unloadable_version=self.versions.lease_claims()["unloadable_version"],
            news_after=news_after,
            **(peers.heartbeat_fields() if (peers := self.versions.peers) else {}),
        )
        r = self.call(ControllerClient.heartbeat, hb, patient=False)
        if r.heartbeat_interval_s:  # the controller spaces heartbeats out as the fleet grows
            self.heartbeat_interval_s = min(max(r.heartbeat_interval_s, 0.1), 300.0)
        self.versions.hear(r)
        self.standing.update(active=r.active, run_over=r.run_over)

    def want_news(self, wanted: bool) -> None:
        """While `wanted` (a partial-rollout lease is generating) every heartbeat is one the
        controller holds until a newer version is announced (at most an interval), sent
        again as soon as it is answered: the lease hears of a version when it is published,
        not up to a heartbeat interval later (bridge/control/http/version_news.py)."""
        self._news_wanted = wanted
        if wanted:
            self._hb_wake.set()

    def _heartbeat_loop(self) -> None:
        next_at = time.monotonic() + self.heartbeat_interval_s
        while True:
            news = self._news_wanted
            due = self._hold_from if news else next_at
            self._hb_wake.wait(max(0.0, due - time.monotonic()))
            self._hb_wake.clear()
            if self._hb_stop.is_set():
                return
            if news != self._news_wanted or time.monotonic() < due:
                continue  # woken by want_news: wait for what is due now
            sent, before = time.monotonic(), self.versions.announced.published_at
            self._holding = news
            try:
                self.heartbeat_once(news_after=before if news else None)
            except ConnectionError:
                pass  # `contact` said so once already; the main loop decides when to give up
            except Exception as e:  # noqa: BLE001 - a missed heartbeat must not kill the thread
                logging.warning("heartbeat failed: %s", e)
            finally:
                self._holding = False
            next_at = time.monotonic() + self.heartbeat_interval_s
            # A held heartbeat that brought no news was held its whole interval, or went to a
            # controller that does not hold (its FastAPI route, an outage): the next one no
            # sooner than an interval after this one was sent, never in a tight loop.
            quiet = news and self.versions.announced.published_at <= before
            self._hold_from = sent + self.heartbeat_interval_s if quiet else time.monotonic()

    def start_heartbeats(self) -> None:
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, daemon=True, name="hb")
        self._hb_thread.start()

    def stop_heartbeats(self) -> None:
        self._hb_stop.set()
        self._hb_wake.set()
        if self._hb_thread is not None:
            # A held heartbeat may wait for a publish for an interval: a stopping worker does
            # not (its reply only brings news; the thread is a daemon).
            self._hb_thread.join(timeout=0.5 if self._holding else 5)

    def leave(self) -> None:
        """Stop heartbeats and tell the controller (it requeues anything still held)."""
        self.stop_heartbeats()
        if self.client is not None and not self.contact.expired():
            try:
                self.call(ControllerClient.leave, patient=False)
            except (ControllerError, ConnectionError) as e:
                logging.warning("leave failed (leases will expire instead): %s", e)
            self.client.close()
