"""A slow-but-progressing parent relay (real relays on loopback, no vLLM): with a per-chunk
minimum rate (`worker.peer_min_bytes_per_s`, rollout_gpu/peer_fetch.py) the child drops it
and reads the rest from the next source; an honest parent above the rate keeps its child.

The slow parent is a real relay throttled to 30 kB/s (the throttled-peer tests' rate): it
sends a 256 KiB chunk every ~9 s, so it never stalls for the child's `stall_s` (120 s
here) and, without a minimum rate, serves the whole version at its pace (~70 s)."""

import numpy as np
import pytest

from bridge.store import chunk_digest
from bridge.store.weight_store import WeightStore
from rollout_gpu.peer_fetch import MIN_RATE_GRACE_S, sources_for
from rollout_gpu.uplink import PIECE

VERSION = 3
SLOW = 30e3  # bytes/s of the slow parent's uplink, after one piece of burst
MIN_RATE = 300e3  # the child's floor: 10x the slow parent, far under loopback


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A file store holding VERSION: 2.4 MB of bf16 in chunks of one uplink piece (256 KiB),
    so each chunk the slow parent sends takes PIECE / SLOW ~ 8.7 s, well past the grace."""
    monkeypatch.setattr(chunk_digest, "CHUNK_BYTES", PIECE)
    s = WeightStore(str(tmp_path / "store"))
    rng = np.random.default_rng(0)
    s.publish(VERSION, 1, [("w", rng.standard_normal((2400, 500)).astype(np.float32))], {},
              dtype="bfloat16")  # fmt: skip
    return s


def _same(store, relay) -> None:
    want, got = store.read_all(VERSION), relay.store.read_all(VERSION)  # verified reads
    assert np.array_equal(want["w"].view(np.uint16), got["w"].view(np.uint16))


def test_a_parent_slower_than_the_minimum_rate_is_dropped_for_the_store(store, relays):
    assert PIECE / SLOW > 4 * MIN_RATE_GRACE_S  # the arithmetic the test stands on
    parent = relays(up_bytes_per_s=SLOW, up_burst_bytes=PIECE)
    parent.fetch(VERSION, [store.spec])
    child = relays(stall_s=120.0, min_rate=MIN_RATE)
    result = child.fetch(VERSION, sources_for(parent.url, [], store.spec), timeout=300)
    _same(store, child)
    dead = [r for r in result.reports if r["source"] == parent.url and r["kind"] == "dead"]
    assert dead and "too slow" in dead[0]["detail"], result.reports
    # At most the burst's chunk and one per concurrent request came from the parent before
    # it was dropped; the store served the rest.
    m = store.manifest(VERSION).total_bytes
    assert result.bytes_from_store > m / 2, result.bytes_by_source


def test_an_honest_parent_above_the_minimum_rate_serves_everything(store, relays):
    parent = relays()  # loopback, unthrottled: MB/s even on a loaded machine
    parent.fetch(VERSION, [store.spec])
    child = relays(min_rate=MIN_RATE)
    result = child.fetch(VERSION, sources_for(parent.url, [], store.spec), timeout=300)
    _same(store, child)
    assert not result.reports
    m = store.manifest(VERSION).total_bytes
    assert result.bytes_by_source[parent.url] > m * 0.99
