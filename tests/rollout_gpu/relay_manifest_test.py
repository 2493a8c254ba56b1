"""A relay told to fetch a version checks its manifest against the hash the controller
announced, on every path (over real HTTP on loopback, no vLLM): a peer's POST /fetch must
name the hash, a copy held already (begun on another peer's instruction) whose manifest
differs is refused and dropped, a source serving another manifest is refused with a clear
error, and nothing is loaded either way. The controller announces the hash it read."""

import os

import httpx
import numpy as np
import pytest

from bridge.broadcast import chunks as chunks_lib
from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.store.layout import LAYOUT
from bridge.store.weight_store import WeightStore
from bridge.tasks import make_task
from rollout_gpu.peer_fetch import FetchError
from rollout_gpu.relay import Relay

VERSION = 5


def published(path, seed: int) -> tuple[WeightStore, str]:
    s = WeightStore(str(path))
    a = np.random.default_rng(seed).standard_normal((64, 64)).astype(np.float32)
    s.publish(VERSION, 1, [("a", a)], {})
    raw = s.kv.read(LAYOUT.manifest_key(VERSION)).result().value
    return s, chunks_lib.manifest_sha256(raw)


@pytest.fixture
def relay():
    r = Relay(control=True)
    r.start()
    yield r
    r.stop()


def fetch(relay, sources, sha=None):
    body = {"version": VERSION, "sources": sources}
    if sha is not None:
        body["manifest_sha256"] = sha
    return httpx.post(f"{relay.url}/fetch", json=body, timeout=10)


def held_manifest(relay) -> int:
    key = LAYOUT.manifest_key(VERSION)
    return httpx.get(f"{relay.url}/kv/{key}", params={"wait": "0"}, timeout=10).status_code


def wait_until(cond, timeout_s=30.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_every_fetch_checks_the_announced_manifest(tmp_path, relay):
    honest, sha = published(tmp_path / "honest", 0)
    other, other_sha = published(tmp_path / "other", 1)  # same version number, other bytes
    assert sha != other_sha
    # A POST /fetch naming no hash would take the manifest from a store the caller names.
    r = fetch(relay, [other.spec])
    assert r.status_code == 400 and "manifest_sha256" in r.text
    # A peer has the relay hold its own version 5 (consistent with the hash it names) ...
    assert fetch(relay, [other.spec], other_sha).status_code == 202
    wait_until(lambda: relay.holds(VERSION, None))
    # ... then the controller's instruction arrives: the held copy is refused and dropped.
    r = fetch(relay, [honest.spec], sha)
    assert r.status_code == 409 and f"not the announced {sha}" in r.json()["error"]
    assert held_manifest(relay) != 200 and str(VERSION) not in relay.status()["versions"]
    # A source serving another manifest: refused with a clear error, nothing begun.
    assert fetch(relay, [other.spec], sha).status_code == 202
    wait_until(lambda: str(VERSION) in relay.status()["errors"])
    assert f"announced sha256 {sha}" in relay.status()["errors"][str(VERSION)]
    assert held_manifest(relay) != 200 and str(VERSION) not in relay.status()["versions"]
    # A worker's own fetch (the path its PeerSwap takes) on a relay holding the other copy.
    relay.fetch(VERSION, [other.spec], other_sha, timeout=30)
    with pytest.raises(FetchError, match="nothing loaded"):
        relay.fetch(VERSION, [honest.spec], sha, timeout=30)
    assert not relay.holds(VERSION, None)
    # The announced copy itself is fetched and served.
    relay.fetch(VERSION, [honest.spec], sha, timeout=30)
    assert held_manifest(relay) == 200


def test_the_controller_announces_the_manifest_hash(tmp_path):
    store, sha = published(tmp_path / "store", 0)
    ctl = Controller(ControllerConfig(), os.path.join(tmp_path, "c.db"), make_task("arithmetic"))
    try:
        assert ctl.publish(VERSION, store.spec).manifest_sha256 == sha
        assert ctl.announcement().manifest_sha256 == sha
    finally:
        ctl.close()
