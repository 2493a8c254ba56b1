"""A relay against hostile peers (issue 23 item 3), over real HTTP on loopback (no vLLM):
every parameter is checked before use (a NaN `wait` used to spin the event loop), a peer
that does not read loses the uplink within `max_send_s`, and in-flight requests are capped."""

import socket
import threading
import time

import httpx
import numpy as np
import pytest

from bridge.store import chunk_digest
from bridge.store.layout import LAYOUT
from bridge.store.weight_store import WeightStore
from rollout_gpu.relay import Relay

VERSION = 5
BIG = 16 << 20  # one chunk: far more than loopback's socket buffers hold for a non-reader


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A file store holding VERSION: one array stored as a single 16 MiB bf16 chunk."""
    monkeypatch.setattr(chunk_digest, "CHUNK_BYTES", BIG)
    s = WeightStore(str(tmp_path / "store"))
    a = np.random.default_rng(0).standard_normal((BIG // 2 // 1024, 1024)).astype(np.float32)
    s.publish(VERSION, 1, [("a", a)], {}, dtype="bfloat16")
    return s


@pytest.fixture
def relay_of(store):
    started = []

    def make(fetch=True, **kw):
        r = Relay(control=True, **kw)
        r.start()
        started.append(r)
        if fetch:
            r.fetch(VERSION, [store.spec], timeout=60)
        return r

    yield make
    for r in started:
        r.stop()


def chunk_key(relay):
    [key] = [k for k in relay.versions[VERSION].plan if "/a/" in k]
    return key


def test_bad_parameters_are_refused_and_change_nothing(relay_of):
    relay = relay_of()
    before = relay.status()["versions"]
    manifest = LAYOUT.manifest_key(VERSION)
    absent = LAYOUT.manifest_key(VERSION + 1)  # not here: a valid wait would hold the request
    with httpx.Client(base_url=relay.url, timeout=5) as c:
        for wait in ("nan", "NaN", "inf", "-inf", "-1", "31", "1e309", "x", "1" * 40):
            r = c.get(f"/kv/{absent}", params={"wait": wait})
            assert r.status_code == 400, (wait, r.status_code)
        for key in ("data/5/a/%01", "x" * 600):
            assert c.get(f"/kv/{key}").status_code == 400, key
        for key in ("data/5/%2E%2E/%2E%2E/etc", "data/5/a/%2F%2F"):  # 400, or normalized: 404
            assert c.get(f"/kv/{key}").status_code in (400, 404), key
        bodies = [
            b'{"version": NaN, "sources": ["/tmp"]}',
            b'{"version": 1e400, "sources": ["/tmp"]}',
            b'{"version": -1, "sources": ["/tmp"]}',
            b'{"version": "6", "sources": ["/tmp"]}',
            b'{"version": true, "sources": ["/tmp"]}',
            b'{"version": 6, "sources": "/tmp"}',
            b'{"version": 6, "sources": []}',
            b'{"version": 6, "sources": ["file:///etc", "/tmp"]}',  # a peer as a store
            b'{"version": 6, "sources": ["/tmp"], "manifest_sha256": "zz"}',
            b'{"version": 6, "sources": [' + b'"http://127.0.0.1:1", ' * 16 + b'"/tmp"]}',
            b"[6]",
            b"not json",
        ]
        for body in bodies:
            r = c.post("/fetch", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, body
        for body in (b'{"version": NaN}', b'{"version": 1e400}', b'{"version": "5"}', b"{}"):
            r = c.post("/forget", content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, body
        # Nothing changed, and the event loop still answers at once.
        assert relay.status()["versions"] == before and relay.status()["clients"] == 0
        assert c.get(f"/kv/{manifest}", params={"wait": "0.5"}).status_code == 200


def test_a_peer_that_does_not_read_loses_the_uplink(store, relay_of):
    relay = relay_of(max_send_s=3.0, stall_s=60.0)
    key = chunk_key(relay)
    want = store.kv.read(key).result().value
    assert len(want) == BIG
    hog = socket.socket()
    hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and never reads
    hog.connect((relay.host, int(relay.url.rsplit(":", 1)[1])))
    hog.sendall(f"GET /kv/{key} HTTP/1.1\r\nHost: relay\r\n\r\n".encode())
    deadline = time.monotonic() + 30
    while not relay._uplink.locked():  # the hog's response holds the uplink now
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t0 = time.monotonic()
    r = httpx.get(f"{relay.url}/kv/{key}", timeout=30)
    elapsed = time.monotonic() - t0
    assert r.status_code == 200 and r.content == want
    assert elapsed < 20, elapsed  # the hog had the uplink for max_send_s, not stall_s
    # The hog's connection was cut before it got the chunk.
    hog.settimeout(10)
    got = 0
    try:
        while chunk := hog.recv(1 << 20):
            got += len(chunk)
    except (ConnectionResetError, TimeoutError):
        pass
    hog.close()
    assert got < BIG


def test_in_flight_requests_are_capped(store, relay_of):
    relay = relay_of(fetch=False, max_clients=2)
    url = f"{relay.url}/kv/{LAYOUT.manifest_key(VERSION)}"
    answers = []

    def wait_for_manifest():  # held by the relay until it has the version
        answers.append(httpx.get(url, params={"wait": "30"}, timeout=60).status_code)

    waiters = [threading.Thread(target=wait_for_manifest) for _ in range(2)]
    for t in waiters:
        t.start()
    deadline = time.monotonic() + 30
    while relay.status()["clients"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    r = httpx.get(url, params={"wait": "30"}, timeout=5)  # a third: refused at once
    assert r.status_code == 429 and r.headers["Retry-After"] == "1"
    relay.fetch(VERSION, [store.spec], timeout=60)  # the held requests are answered
    for t in waiters:
        t.join(timeout=60)
    assert answers == [200, 200] and relay.status()["clients"] == 0
    assert httpx.get(url, timeout=5).status_code == 200
