"""Abuse limits (bridge/control/trust/limits.py, join_secret.py): token buckets, 429 + Retry-After
over real HTTP, registration per IP, in-flight leases per worker, token expiry with the
worker session registering again, and join-secret rotation without a restart."""

import os
import time

import httpx
import pytest

from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.http.client import ControllerClient, ControllerError
from bridge.control.http.service import ServerOptions, serve_controller
from bridge.control.protocol import Heartbeat, LeaseRequest, SamplingParams, WorkerProfile
from bridge.control.trust.join_secret import JoinSecret
from bridge.control.trust.limits import RateLimiter
from bridge.tasks import make_task
from rollout_gpu.session import ControllerSession, FatalError, WorkerOptions

PROFILE = WorkerProfile(accelerator="cpu", price_per_hour=0.5, max_concurrent_sequences=64)


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def make(tmp_path, text_codec, clock=time.time, **cfg):
    base = dict(staleness=1, groups_per_step=4, group_size=2, sampling=SamplingParams(max_tokens=4))
    return Controller(
        ControllerConfig(**{**base, **cfg}),
        str(tmp_path / "ctl.db"),
        make_task("arithmetic"),
        clock,
        codec=text_codec,
    )


@pytest.fixture
def serve(tmp_path, text_codec):
    """serve(clock=..., **ControllerConfig fields) -> (controller, server, join secret)."""
    made = []

    def start(clock=time.time, **cfg):
        ctl = make(tmp_path, text_codec, clock, **cfg)
        server = serve_controller(ctl, str(tmp_path), ServerOptions())
        made.append((ctl, server))
        with open(tmp_path / "join_token") as f:
            return ctl, server, f.read().strip()

    yield start
    for ctl, server in made:
        server.stop()
        ctl.close()


def test_token_bucket_burst_refill_and_bounded_table():
    clock = Clock(0.0)
    rl = RateLimiter(rate_per_s=2.0, burst=3, clock=clock, max_keys=8)
    assert [rl.take("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert rl.take("a") == pytest.approx(0.5)  # one token refills in 1 / rate
    assert rl.take("b") == 0.0  # buckets are per key
    clock.t += 0.5
    assert rl.take("a") == 0.0 and rl.take("a") > 0
    for i in range(100):  # a flood of keys: full buckets are forgotten, the table stays small
        clock.t += 1.0
        rl.take(f"k{i}")
    assert len(rl._buckets) <= 9
    assert RateLimiter(0.0, 1).take("x") == 0.0  # rate 0: no limit


class HeldClock:
    """Frozen until `running` is set; then it runs in real time from the frozen reading,
    starting at its first read after that (so that read still sees the empty bucket). The
    buckets refill only when the test lets them, however slow the box."""

    def __init__(self):
        self.t0, self.running, self.started = time.monotonic(), False, None

    def __call__(self) -> float:
        if not self.running:
            return self.t0
        if self.started is None:
            self.started = time.monotonic()
        return self.t0 + time.monotonic() - self.started


def test_rate_limit_429_retry_after_counted_per_worker_and_endpoint(serve):
    ctl, server, secret = serve(rate_limit_per_s=1.0, rate_limit_burst=3)
    clock = ctl.limits.workers.clock = HeldClock()
    a, _ = ControllerClient.join(server.url, secret, PROFILE)
    b, _ = ControllerClient.join(server.url, secret, PROFILE)
    bearer = {"Authorization": f"Bearer {a.token}"}
    codes = [httpx.get(server.url + "/v1/version", headers=bearer).status_code for _ in range(4)]
    assert codes == [200, 200, 200, 429]
    r = httpx.get(server.url + "/v1/version", headers=bearer)
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert 0 < r.json()["retry_after_s"] <= 1.0
    # Another worker, and another endpoint of the same worker, have their own buckets.
    assert httpx.get(server.url + "/v1/version", headers={"Authorization": f"Bearer {b.token}"})
    hb = httpx.post(server.url + "/v1/heartbeat", headers=bearer, json={"worker_version": -1})
    assert hb.status_code == 200
    assert ctl.stats()["fleet/rate_limited"] == 2
    # The typed client waits out a 429 instead of failing.
    clock.running = True
    t0 = time.monotonic()
    assert a.version().version == -1
    assert time.monotonic() - t0 > 0.2
    a.close()
    b.close()


def test_registration_is_limited_per_client_ip(serve):
    ctl, server, secret = serve(register_rate_per_s=0.01, register_burst=2)
    url, body = server.url + "/v1/register", {"profile": PROFILE.model_dump()}
    assert httpx.post(url, json={**body, "join_secret": "wrong"}).status_code == 403
    assert httpx.post(url, json={**body, "join_secret": secret}).status_code == 200
    r = httpx.post(url, json={**body, "join_secret": secret})  # guesses cost tokens too
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    assert ctl.stats()["fleet/rate_limited"] == 1


def test_in_flight_leases_are_bounded_per_worker(tmp_path, text_codec):
    ctl = make(tmp_path, text_codec, max_leases_per_worker=2, groups_per_step=16)
    ctl.publish(0)
    w, _ = ctl.register(PROFILE)
    req = LeaseRequest(worker_version=0, max_groups=1)
    first, second = ctl.lease(w, req).lease, ctl.lease(w, req).lease
    assert first and second
    r = ctl.lease(w, req)
    assert r.lease is None and r.reason == "lease_limit" and r.retry_after_s > 0
    other, _ = ctl.register(PROFILE)  # the bound is per worker, not global
    assert ctl.lease(other, req).lease is not None
    assert ctl.release(w, first.lease_id)
    assert ctl.lease(w, req).lease is not None
    ctl.close()


def test_token_expires_without_contact_and_the_session_registers_again(serve):
    clock = Clock(time.time())
    ctl, server, secret = serve(clock=clock, token_ttl_s=100.0)
    session = ControllerSession(
        WorkerOptions(controller=server.url, join_secret=secret, profile=PROFILE)
    )
    session.join()
    first = session.worker_id
    for _ in range(3):  # heartbeats keep the token alive well past one ttl
        clock.t += 60
        session.heartbeat_once()
    assert session.worker_id == first
    assert ctl.authenticate(session.client.token) == first
    clock.t += 101  # silent for longer than the ttl: the token is dead
    assert ctl.authenticate(session.client.token) is None
    with pytest.raises(ControllerError) as e:
        session.client.heartbeat(Heartbeat(worker_version=-1))
    assert e.value.status == 401
    session.heartbeat_once()  # the session registers again on the 401 and goes on
    assert session.worker_id != first
    assert ctl.authenticate(session.client.token) == session.worker_id


def test_join_secret_rotates_without_restart(serve, tmp_path):
    ctl, server, old = serve(join_secret_grace_s=1.5)
    path = str(tmp_path / "join_token")
    veteran, _ = ControllerClient.join(server.url, old, PROFILE)
    with open(path + ".tmp", "w") as f:
        f.write("the-new-secret\n")
    os.replace(path + ".tmp", path)  # atomic, as join_secret.py asks
    time.sleep(1.1)  # the file is checked at most once a second
    ControllerClient.join(server.url, "the-new-secret", PROFILE)[0].close()
    ControllerClient.join(server.url, old, PROFILE)[0].close()  # within the grace period
    # The operator path takes the current secret as bearer too.
    status = httpx.get(
        server.url + "/v1/status", headers={"Authorization": "Bearer the-new-secret"}
    )
    assert status.status_code == 200
    time.sleep(1.6)
    with pytest.raises(ControllerError) as e:
        ControllerClient.join(server.url, old, PROFILE)
    assert e.value.status == 403
    assert veteran.version().version == -1  # registered workers keep their tokens
    veteran.close()
    # A worker started with the old secret but told its --token_file follows the rotation.
    opts = WorkerOptions(controller=server.url, join_secret=old, profile=PROFILE, token_file=path)
    ControllerSession(opts).join()
    stuck = WorkerOptions(controller=server.url, join_secret=old, profile=PROFILE)
    with pytest.raises(FatalError):
        ControllerSession(stuck).join()


def test_join_secret_ignores_a_half_written_file(tmp_path):
    path = tmp_path / "join_token"
    path.write_text("first\n")
    clock = Clock(0.0)
    secret = JoinSecret.from_file(str(path), grace_s=10, check_every_s=0, clock=clock)
    path.write_text("")  # an editor truncated it: keep the current secret
    assert secret.matches("first") and not secret.matches("")
    path.write_text("second\n")
    assert secret.refresh(force=True) is True
    assert secret.matches("second") and secret.matches("first")
    clock.t += 11
    assert secret.matches("second") and not secret.matches("first")
