"""Held heartbeats (bridge/control/http/version_news.py, issue 48), over real HTTP on
loopback: a heartbeat carrying `news_after` is answered when a version published after it is
announced, not at the end of its hold; one that is already behind is answered at once; one
with no news is answered after its hold, with the ordinary reply. And the worker's side
(rollout_gpu/session.py `want_news`): its heartbeat thread, at a heartbeat interval far
longer than the test, hears of a publish through a held heartbeat.

Timing here is only hang guards: each check reads which version a reply carries, and the
holds (HOLD_S) are far longer than anything the checks wait for.
"""

import threading
import time

import httpx
from controller_helpers import Clock, make, register

from bridge.control.http.service import ServerOptions, load_or_create_join_secret, serve_controller
from bridge.control.http.version_news import MAX_HOLD_S
from bridge.control.protocol import WorkerProfile
from rollout_gpu.session import ControllerSession, WorkerOptions

HOLD_S = 20.0  # the controller's heartbeat interval: each held heartbeat's hold
STORE = {"driver": "memory"}


def _serve(tmp_path, hold_s=HOLD_S):
    clock = Clock()
    ctl = make(tmp_path, clock, heartbeat_interval_s=hold_s)
    ctl.publish(0, STORE)
    return clock, ctl, serve_controller(ctl, str(tmp_path), ServerOptions())


def _publish_later(ctl, clock, version, after_s):
    def later():
        time.sleep(after_s)
        clock.t += 1.0
        ctl.publish(version, STORE)

    t = threading.Thread(target=later, daemon=True)
    t.start()
    return t


def _session(tmp_path, server) -> ControllerSession:
    """A worker's session (not joined) with the controller's join secret."""
    secret = load_or_create_join_secret(str(tmp_path))
    profile = WorkerProfile(accelerator="cpu", price_per_hour=0.0, max_concurrent_sequences=8)
    opts = WorkerOptions(controller=server.url, join_secret=secret, profile=profile)
    return ControllerSession(opts)


def test_a_held_heartbeat_is_answered_by_the_next_publish(tmp_path):
    clock, ctl, server = _serve(tmp_path)
    try:
        with httpx.Client(base_url=server.url, timeout=MAX_HOLD_S + 30) as client:
            headers = register(client, load_or_create_join_secret(str(tmp_path)))
            v0 = ctl.announcement()
            publisher = _publish_later(ctl, clock, 1, 0.5)
            t0 = time.monotonic()
            body = {"worker_version": 0, "news_after": v0.published_at}
            r = client.post("/v1/heartbeat", headers=headers, json=body)
            waited = time.monotonic() - t0
            publisher.join()
            assert r.status_code == 200, r.text
            # Answered by the publish (it carries version 1), well before the hold's end.
            assert r.json()["announcement"]["version"] == 1
            assert waited < HOLD_S, waited
            # A worker already behind is answered at once with the newest version.
            r = client.post("/v1/heartbeat", headers=headers, json=body)
            assert r.json()["announcement"]["version"] == 1
            # A republish of the same number (a healed head) is news too: published later.
            news_after = r.json()["announcement"]["published_at"]
            publisher = _publish_later(ctl, clock, 1, 0.2)
            body = {"worker_version": 1, "news_after": news_after}
            r = client.post("/v1/heartbeat", headers=headers, json=body)
            publisher.join()
            assert r.json()["announcement"]["published_at"] > news_after
            # Malformed: a negative time is refused like any bad field.
            bad = {"worker_version": 1, "news_after": -1.0}
            r = client.post("/v1/heartbeat", headers=headers, json=bad)
            assert r.status_code == 422
    finally:
        server.stop()
        ctl.close()


def test_a_held_heartbeat_without_news_ends_with_its_hold(tmp_path):
    clock, ctl, server = _serve(tmp_path, hold_s=0.3)  # a short hold: nothing is published
    try:
        with httpx.Client(base_url=server.url, timeout=MAX_HOLD_S + 30) as client:
            headers = register(client, load_or_create_join_secret(str(tmp_path)))
            v0 = ctl.announcement()
            t0 = time.monotonic()
            body = {"worker_version": 0, "news_after": v0.published_at}
            r = client.post("/v1/heartbeat", headers=headers, json=body)
            assert r.status_code == 200, r.text
            assert time.monotonic() - t0 >= 0.3  # held for its interval, not answered at once
            assert r.json()["announcement"]["version"] == 0
    finally:
        server.stop()
        ctl.close()


def test_the_worker_hears_a_publish_through_its_held_heartbeats(tmp_path):
    """At a 20 s heartbeat interval a plain heartbeat thread would hear of version 1 after
    up to 20 s; with `want_news` it hears of it when it is published."""
    clock, ctl, server = _serve(tmp_path)
    session = _session(tmp_path, server)
    try:
        session.join()
        assert session.heartbeat_interval_s == HOLD_S
        session.start_heartbeats()
        session.want_news(True)
        # Version 2: the next held heartbeat was sent at once and hears the next publish too.
        for version in (1, 2):
            time.sleep(0.3)  # a held heartbeat in flight (before it, one is answered at once)
            clock.t += 1.0
            ctl.publish(version, STORE)
            deadline = time.monotonic() + HOLD_S / 2
            while session.versions.announced.version != version:
                assert time.monotonic() < deadline, f"{version} not heard in half an interval"
                time.sleep(0.02)
    finally:
        session.want_news(False)
        session.stop_heartbeats()
        server.stop()
        ctl.close()


def test_with_holds_off_a_news_heartbeat_is_answered_at_once_and_not_resent_in_a_loop(tmp_path):
    """`controller.news_hold=False`: answered at once; the worker then sends its next
    heartbeat an interval later, as without `want_news` (no tight loop of quick answers)."""
    clock = Clock()
    ctl = make(tmp_path, clock, heartbeat_interval_s=HOLD_S, news_hold=False)
    ctl.publish(0, STORE)
    calls = []
    real = ctl.heartbeat
    ctl.heartbeat = lambda *args: (calls.append(args), real(*args))[1]
    server = serve_controller(ctl, str(tmp_path), ServerOptions())
    session = _session(tmp_path, server)
    try:
        session.join()
        session.start_heartbeats()
        session.want_news(True)
        deadline = time.monotonic() + HOLD_S / 2
        while not calls:
            assert time.monotonic() < deadline, "no held heartbeat sent"
            time.sleep(0.02)
        assert calls[0][1].news_after is not None  # it asked to be held, and was not
        time.sleep(1.0)
        assert len(calls) == 1, len(calls)
    finally:
        session.want_news(False)
        session.stop_heartbeats()
        server.stop()
        ctl.close()
