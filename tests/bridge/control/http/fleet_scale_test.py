"""The control plane at fleet scale (issue 25) and its HTTP hardening (issue 23 item 10),
through the public interface: real HTTP on loopback, raw sockets where a client library
would refuse to send the attack.

Group commit: an acknowledged submission's reply waits for the fsync that covers it, a
heartbeat never waits for the disk, and commits that arrive during an fsync share the next.
The heartbeat interval grows with the fleet. Bodies: the size limit holds whatever the
framing (Transfer-Encoding in any letter case), JSON depth and element counts are refused
on the raw bytes, a submission is parsed off the event loop (a heartbeat is answered while
one is being parsed), unauthenticated requests are rate limited per address.
"""

import json
import socket
import threading

import httpx
import pytest
from controller_helpers import blocking_fsync, dump, make, register, worker

from bridge.control.http import body_parse
from bridge.control.http import service as service_lib
from bridge.control.http.service import ServerOptions, serve_controller
from bridge.control.protocol import Heartbeat, LeaseRequest
from bridge.control.state.db import ControllerDB
from tests.controller_helpers import submission_json


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def _lease(ctl, client, headers):
    ctl.publish(0, {"driver": "memory"})
    r = client.post("/v1/lease", headers=headers, json={"worker_version": 0, "max_groups": 1})
    assert r.status_code == 200, r.text
    return r.json()["lease"]


def _submit_in_background(server, headers, lease):
    """POST the lease's submission on a thread: (the started thread, its reply list)."""
    replies = []
    t = threading.Thread(
        target=lambda: replies.append(
            httpx.post(
                server.url + "/v1/submit", headers=headers, json=submission_json(lease), timeout=60
            )
        )
    )
    t.start()
    return t, replies


def test_group_commit_one_fsync_covers_every_commit_that_waited(tmp_path):
    db = ControllerDB(str(tmp_path / "c.db"))
    entered, release = blocking_fsync(db.group_commit)
    committed = threading.Barrier(9, timeout=30)
    writer = (
        threading.Lock()
    )  # one transaction at a time on the connection, as the controller's lock

    def first():
        with writer, db.tx():
            db.put("k0", 0)
        db.sync()

    def later(i):
        with writer, db.tx():
            db.put(f"k{i}", i)
        committed.wait()
        db.sync()

    threads = [threading.Thread(target=first)]
    threads[0].start()
    assert entered.wait(30)  # the first commit's fsync is on the disk now
    threads += [threading.Thread(target=later, args=(i,)) for i in range(1, 9)]
    for t in threads[1:]:
        t.start()
    committed.wait()  # all 8 later commits are in the WAL before the first fsync ends
    release.set()
    for t in threads:
        t.join(30)
    assert db.group_commit.fsyncs == 2  # 9 commits, 2 fsyncs: the 8 later ones share one
    db.close()


def test_acknowledged_submission_waits_for_its_fsync_heartbeat_does_not(service):
    ctl, server, client, secret, _ = service
    headers = register(client, secret)
    lease = _lease(ctl, client, headers)
    entered, release = blocking_fsync(ctl.db.group_commit)
    t, replies = _submit_in_background(server, headers, lease)
    assert entered.wait(30), "the submission never asked for an fsync"
    # Committed, not yet on disk: no reply yet. A heartbeat is answered meanwhile.
    hb = client.post("/v1/heartbeat", headers=headers, json={"worker_version": 0})
    assert hb.status_code == 200, hb.text
    t.join(0.5)
    assert t.is_alive() and not replies
    release.set()
    t.join(30)
    assert replies[0].status_code == 200 and replies[0].json()["accepted"]


def test_a_lease_grant_waits_for_its_fsync_a_refusal_does_not(tmp_path):
    """A refusal ("full", "behind") promises nothing, so it is answered while the disk
    works: 2000 workers' refusals each waited for an fsync before."""
    ctl = make(tmp_path, staleness=0, groups_per_step=1, max_groups_per_lease=1)
    ctl.publish(0)
    a, b = worker(ctl), worker(ctl)
    entered, release = blocking_fsync(ctl.db.group_commit)
    replies = {}

    def ask(w):
        replies[w] = ctl.lease(w, LeaseRequest(worker_version=0, max_groups=1))

    grant = threading.Thread(target=ask, args=(a,))
    grant.start()
    assert entered.wait(30), "the grant never asked for an fsync"
    grant.join(0.5)
    assert grant.is_alive() and a not in replies  # granted, not yet on disk: no reply
    refusal = threading.Thread(target=ask, args=(b,))
    refusal.start()
    refusal.join(10)
    assert not refusal.is_alive() and replies[b].reason == "full"  # while the disk works
    release.set()
    grant.join(30)
    assert replies[a].lease is not None


def test_heartbeat_interval_grows_with_the_fleet(tmp_path):
    clock = FakeClock()
    ctl = make(
        tmp_path, clock=clock, heartbeat_interval_s=2.0, heartbeat_budget_per_s=4.0,
        worker_timeout_s=30.0,
    )  # fmt: skip
    ids = [worker(ctl) for _ in range(40)]
    beat = lambda w: ctl.heartbeat(w, Heartbeat(worker_version=-1)).heartbeat_interval_s  # noqa: E731
    assert beat(ids[0]) == 2.0  # one worker: the shortest
    for w in ids[:24]:
        beat(w)
    clock.t += 1.5
    assert beat(ids[0]) == 24 / 4.0  # 24 live workers / 4 per s
    for w in ids:
        beat(w)
    clock.t += 1.5
    assert beat(ids[0]) == 10.0  # 40 / 4 = 10 = worker_timeout_s / 3, the cap
    clock.t += 31.0  # all but one silent past the timeout: back to the shortest
    assert beat(ids[0]) == 2.0
    ctl.close()


def _raw(url: str, request: bytes) -> tuple[int, bytes]:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
            if b"\r\n\r\n" in data:
                head, _, rest = data.partition(b"\r\n\r\n")
                n = [
                    int(x.split(b":")[1])
                    for x in head.split(b"\r\n")
                    if x.lower().startswith(b"content-length")
                ]
                if n and len(rest) >= n[0]:
                    break
    return int(data.split(b" ")[1]), data


@pytest.mark.parametrize("encoding", [b"chunked", b"Chunked", b"CHUNKED"])
def test_body_limit_holds_for_any_transfer_encoding_case(service, encoding):
    ctl, server, client, secret, _ = service
    headers = register(client, secret)
    before = dump(ctl)
    body = json.dumps({"worker_version": 0, "relay_url": "x" * 100_000}).encode()  # > 64 KiB
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(body[i : i + 8192]), body[i : i + 8192])
        for i in range(0, len(body), 8192)
    )
    req = (
        b"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Authorization: " + headers["Authorization"].encode() + b"\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: "
        + encoding
        + b"\r\n\r\n"
        + chunks
        + b"0\r\n\r\n"
    )
    status, _ = _raw(server.url, req)
    assert status in (411, 413)
    assert dump(ctl) == before


def test_json_depth_and_element_counts_refused_before_parsing(tmp_path):
    ctl = make(tmp_path)
    workdir = str(tmp_path)
    opts = ServerOptions(max_json_depth=8, max_json_elements=1000)
    server = serve_controller(ctl, workdir, opts)
    secret = service_lib.load_or_create_join_secret(workdir)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            headers = register(client, secret)
            as_json = {**headers, "Content-Type": "application/json"}
            before = dump(ctl)
            deep = '{"worker_version": 0, "broadcast": ' + "[" * 20 + "]" * 20 + "}"
            r = client.post(
                "/v1/heartbeat",
                headers=as_json,
                content=deep,
            )
            assert r.status_code == 413 and "nested" in r.text
            wide = json.dumps({"worker_version": 0, "max_groups": 1, "x": [0] * 2000})
            r = client.post("/v1/lease", headers=as_json, content=wide)
            assert r.status_code == 413 and "elements" in r.text
            assert dump(ctl) == before
            # Brackets inside strings are text, not structure.
            ok = json.dumps({"worker_version": 0, "relay_url": "[" * 50})
            r = client.post("/v1/heartbeat", headers=as_json, content=ok)
            assert r.status_code == 200, r.text
    finally:
        server.stop()
        ctl.close()


def test_submission_parsed_off_the_event_loop(service, monkeypatch):
    ctl, server, client, secret, _ = service
    headers = register(client, secret)
    lease = _lease(ctl, client, headers)
    parsing, release = threading.Event(), threading.Event()
    real = body_parse.Submission

    class SlowSubmission(real):
        @classmethod
        def model_validate_json(cls, data, **kw):
            parsing.set()
            assert release.wait(30)
            return real.model_validate_json(data, **kw)

    monkeypatch.setattr(body_parse, "Submission", SlowSubmission)
    t, replies = _submit_in_background(server, headers, lease)
    assert parsing.wait(30)
    # The parse is stuck; the event loop is not: a heartbeat is answered.
    hb = client.post("/v1/heartbeat", headers=headers, json={"worker_version": 0}, timeout=10)
    assert hb.status_code == 200
    release.set()
    t.join(30)
    assert replies[0].status_code == 200, replies[0].text


def test_unauthenticated_requests_rate_limited_per_address(service):
    ctl, server, client, secret, _ = service
    burst = int(ctl.config.register_burst)
    codes = [
        client.post("/v1/heartbeat", headers={"Authorization": "Bearer nope"}, json={}).status_code
        for _ in range(burst + 3)
    ]
    assert codes[0] == 401 and codes[-1] == 429
    assert ctl.limits.by_endpoint.get("other", 0) >= 1


def _served(tmp_path, **options):
    ctl = make(tmp_path)
    server = serve_controller(ctl, str(tmp_path), ServerOptions(**options))
    host, port = server.url.removeprefix("http://").split(":")
    return ctl, server, (host, int(port))


def _get(sock) -> bytes:
    """One GET /openapi.json on a kept-alive connection: the response's first bytes, or b""
    if the server closed the connection instead."""
    try:
        sock.sendall(b"GET /openapi.json HTTP/1.1\r\nHost: x\r\n\r\n")
        return sock.recv(64)
    except ConnectionResetError:
        return b""


def test_headers_must_arrive_within_the_timeout(tmp_path):
    ctl, server, addr = _served(tmp_path, header_timeout_s=0.3)
    try:
        with socket.create_connection(addr, timeout=30) as slow:
            slow.sendall(b"POST /v1/heartbeat HTTP/1.1\r\nHost: x\r\n")  # and nothing more
            assert slow.recv(1024) == b""  # closed by the server (a hang fails at 30 s)
        with socket.create_connection(addr, timeout=30) as kept:
            kept.sendall(b"GET /v1/version HTTP/1.1\r\nHost: x\r\n\r\n")  # whole headers
            first = kept.recv(1 << 16)
            assert first.startswith(b"HTTP/1.1 401") and first.endswith(b"}")  # answered
            kept.sendall(b"GET /v1/version HTTP/1.1\r\n")  # the next request stalls
            assert kept.recv(1024) == b""
    finally:
        server.stop()
        ctl.close()


def test_connections_per_peer_are_bounded(tmp_path, monkeypatch):
    from bridge.control.http import http_bounds

    monkeypatch.setattr(http_bounds, "is_loopback", lambda ip: False)  # count 127.0.0.1
    ctl, server, addr = _served(tmp_path, max_connections_per_peer=3, header_timeout_s=60)
    held = [socket.create_connection(addr, timeout=30) for _ in range(3)]
    try:
        for s in held:
            assert _get(s).startswith(b"HTTP/1.1 200")
        with socket.create_connection(addr, timeout=30) as extra:
            assert _get(extra) == b""  # a fourth from the same address: closed unread
        held.pop().close()
        for _ in range(200):  # the server notices the close asynchronously: retry
            with socket.create_connection(addr, timeout=30) as again:
                if _get(again).startswith(b"HTTP/1.1 200"):
                    break
        else:
            raise AssertionError("a connection freed by a close was never reusable")
    finally:
        for s in held:
            s.close()
        server.stop()
        ctl.close()
