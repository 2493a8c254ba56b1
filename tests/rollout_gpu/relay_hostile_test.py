"""A relay against hostile peers, over real HTTP on loopback (no vLLM): every parameter is
checked before use (a NaN `wait` used to spin the event loop), a peer that does not read
loses its slot within seconds and costs other peers nothing, and in-flight requests are
capped, per peer address too."""

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
    while relay.status()["clients"] < 1:  # the hog's request is in flight
        assert time.monotonic() < deadline
        time.sleep(0.01)
    t0 = time.monotonic()
    r = httpx.get(f"{relay.url}/kv/{key}", timeout=30)  # from the hog's own address
    elapsed = time.monotonic() - t0
    assert r.status_code == 200 and r.content == want
    # Behind the hog in its address's turn: the hog kept it for read_stall_s (5 s) at most
    # once its buffers were full, not for max_send_s or stall_s.
    assert elapsed < 20, elapsed
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


def stalled_reader(relay, key: str, address: str) -> socket.socket:
    """A peer at `address` (another loopback address: another reader) that asks for `key`
    and never reads."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.bind((address, 0))
    s.connect((relay.host, int(relay.url.rsplit(":", 1)[1])))
    s.sendall(f"GET /kv/{key} HTTP/1.1\r\nHost: relay\r\n\r\n".encode())
    return s


def test_readers_that_stop_reading_cost_an_honest_child_nothing(tmp_path, monkeypatch):
    """Two readers that never read hold connections to a relay configured as a worker's;
    an honest child's 4 MiB chunk still arrives within its 10 s read timeout (it waited
    behind them for the relay's 30 s max_send_s before), and they lose their slots."""
    chunk = 4 << 20
    monkeypatch.setattr(chunk_digest, "CHUNK_BYTES", chunk)
    store = WeightStore(str(tmp_path / "store"))
    a = np.random.default_rng(1).standard_normal((chunk // 2 // 1024, 1024)).astype(np.float32)
    store.publish(VERSION, 1, [("a", a)], {}, dtype="bfloat16")
    relay = Relay()
    relay.start()
    try:
        relay.fetch(VERSION, [store.spec], timeout=60)
        key = chunk_key(relay)
        hogs = [stalled_reader(relay, key, ip) for ip in ("127.0.0.2", "127.0.0.3")]
        deadline = time.monotonic() + 30
        while relay.status()["clients"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.get(f"{relay.url}/kv/{key}", timeout=10)
        assert r.status_code == 200 and r.content == store.kv.read(key).result().value
        # Their slots come free: a stalled reader is cut within read_stall_s (5 s) once its
        # socket buffers are full (a reader whose buffers took the whole chunk is done).
        deadline = time.monotonic() + 30
        while relay.status()["clients"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for hog in hogs:
            hog.close()
    finally:
        relay.stop()


def test_each_reader_has_bounded_slots(store, relay_of):
    """Past `per_reader` requests in flight from one address: 429 for that address only;
    past `max_readers` addresses: 429 for a new one."""
    relay = relay_of(fetch=False, per_reader=2, max_readers=2)
    url = f"{relay.url}/kv/{LAYOUT.manifest_key(VERSION)}"
    answers = []

    def wait_for_manifest(address):  # held by the relay until it has the version
        transport = httpx.HTTPTransport(local_address=address)
        with httpx.Client(transport=transport, timeout=60) as c:
            answers.append(c.get(url, params={"wait": "30"}).status_code)

    waiters = [
        threading.Thread(target=wait_for_manifest, args=(ip,))
        for ip in ("127.0.0.1", "127.0.0.1", "127.0.0.2")
    ]
    for t in waiters:
        t.start()
    deadline = time.monotonic() + 30
    while relay.status()["clients"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    for ip, refused in (("127.0.0.1", True), ("127.0.0.2", False), ("127.0.0.3", True)):
        transport = httpx.HTTPTransport(local_address=ip)
        with httpx.Client(transport=transport, timeout=5) as c:
            r = c.get(url, params={"wait": "0"})
        assert (r.status_code == 429) == refused, (ip, r.status_code)
    relay.fetch(VERSION, [store.spec], timeout=60)
    for t in waiters:
        t.join(timeout=60)
    assert answers == [200, 200, 200] and relay.status()["clients"] == 0


def test_readers_share_the_uplink_and_its_measured_rate_counts_wall_time(store, relay_of):
    """Two readers at once (two addresses) on a relay limited to 16 MB/s: both are served
    concurrently, and the relay's measured uplink (which caps its place in the topology)
    counts the wall time its uplink was busy, not each response's time summed (that would
    halve it)."""
    rate = 16e6
    relay = relay_of(up_bytes_per_s=rate, up_burst_bytes=256 << 10)
    key = chunk_key(relay)
    got = {}

    def read(address):
        transport = httpx.HTTPTransport(local_address=address)
        with httpx.Client(transport=transport, timeout=60) as c:
            got[address] = len(c.get(f"{relay.url}/kv/{key}").content)

    readers = [threading.Thread(target=read, args=(ip,)) for ip in ("127.0.0.2", "127.0.0.3")]
    t0 = time.monotonic()
    for t in readers:
        t.start()
    for t in readers:
        t.join(timeout=60)
    wall = time.monotonic() - t0
    assert got == {"127.0.0.2": BIG, "127.0.0.3": BIG}
    # The bucket bounds it from above (plus its burst). From below: what the two reads saw
    # moving over their whole wall time (on a starved CPU that is under the bucket's rate;
    # each response's time summed would give about half of it).
    measured = relay.status()["up_bytes_per_s"]
    assert 0.7 * (2 * BIG / wall) < measured < 1.1 * rate, (measured, 2 * BIG / wall)
