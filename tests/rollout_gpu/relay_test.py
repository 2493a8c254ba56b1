"""Weight relays on loopback (real HTTP, no vLLM): chain transfer, corrupt chunks, a parent
killed mid-transfer, one copy from the origin, and tensorstore's `http` kvstore on a relay."""

import json
import threading
import time

import numpy as np
import pytest
import tensorstore as ts

from bridge.store import chunk_digest
from bridge.store.layout import LAYOUT
from bridge.store.weight_store import WeightStore
from rollout_gpu.peer_fetch import sources_for

VERSION = 5


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A file store holding VERSION: ~1.2 MB of bf16 in 64 KiB chunks (20 of them), plus an
    all-zero array (its chunk is never stored) and a 1-D array with a clipped edge chunk."""
    monkeypatch.setattr(chunk_digest, "CHUNK_BYTES", 64 << 10)
    s = WeightStore(str(tmp_path / "store"))
    rng = np.random.default_rng(0)
    arrays = [
        ("a", rng.standard_normal((2000, 300)).astype(np.float32)),
        ("zeros", np.zeros((16, 8), np.float32)),
        ("b", rng.standard_normal((40001,)).astype(np.float32)),
    ]
    s.publish(VERSION, 1, arrays, {}, dtype="bfloat16")
    return s


def chain_fetch(chain, origin_sources, version=VERSION, may_fail=()):
    """Fetch concurrently down a chain: relay i reads relay i-1, then i-2, then the store."""
    results, errors = {}, {}

    def go(i):
        up = [r.url for r in chain[:i]][::-1]
        srcs = sources_for(up[0] if up else None, up[1:2], origin_sources)
        try:
            results[i] = chain[i].fetch(version, srcs, timeout=120)
        except Exception as e:  # noqa: BLE001 - reported below
            errors[i] = e

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(chain))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(errors) <= set(may_fail), errors
    return results


def assert_same(store, relay):
    want, got = store.read_all(VERSION), relay.store.read_all(VERSION)  # verified reads
    assert want.keys() == got.keys()
    for k in want:
        assert np.array_equal(want[k].view(np.uint16), got[k].view(np.uint16)), k


def test_three_relay_chain_transfers_identical_verified_bytes(store, relays):
    chain = [relays(up_bytes_per_s=4e6) for _ in range(3)]
    results = chain_fetch(chain, store.spec)
    m = store.manifest(VERSION).total_bytes
    for i, r in enumerate(chain):
        assert_same(store, r)
        assert not results[i].reports
    # Only the root read chunks from the store; the others read just the manifest there.
    assert results[0].bytes_from_store > m * 0.99
    for i in (1, 2):
        assert results[i].bytes_from_store < 4096
        assert results[i].bytes_by_source[chain[i - 1].url] > m * 0.99


def test_chunk_corrupted_at_the_middle_relay_is_refetched_and_reported(store, relays):
    bad = set()

    def tamper(key, body):  # the middle relay flips a byte in every third chunk it serves
        if "/c/" in key and hash(key) % 3 == 0:
            bad.add(key)
            return bytes([body[0] ^ 0xFF]) + body[1:]
        return body

    chain = [relays(), relays(tamper=tamper), relays()]
    results = chain_fetch(chain, store.spec)
    assert bad
    assert_same(store, chain[2])
    reports = results[2].reports
    corrupt = [r for r in reports if r["kind"] == "corrupt"]
    assert corrupt and all(r["source"] == chain[1].url for r in corrupt), reports
    # After BAD_LIMIT bad chunks the parent is dropped: the rest came from the grandparent.
    assert results[2].bytes_by_source[chain[0].url] > 0


def test_parent_killed_mid_transfer_is_routed_around(store, relays):
    m = store.manifest(VERSION).total_bytes
    chain = [relays(up_bytes_per_s=m / 2), relays(up_bytes_per_s=m / 2), relays(stall_s=5)]

    def kill_parent():
        while chain[2].status()["versions"].get(str(VERSION), {}).get("have", 0) < 3:
            time.sleep(0.01)
        chain[1].stop()

    killer = threading.Thread(target=kill_parent)
    killer.start()
    results = chain_fetch(chain, store.spec, may_fail={1})  # the killed one's own fetch
    killer.join()
    assert_same(store, chain[2])
    kinds = {(r["source"], r["kind"]) for r in results[2].reports}
    assert (chain[1].url, "dead") in kinds
    assert results[2].bytes_by_source.get(chain[0].url, 0) > 0  # the grandparent took over


def test_a_receiver_joining_mid_broadcast_attaches_at_the_leaf(store, relays):
    """A worker that joins while a version is moving down the chain fetches from the last
    relay (a leaf, as topology.join places it), taking the chunks that relay already
    verified and then each one as it arrives: it finishes, and the store sends it nothing
    but the manifest."""
    m = store.manifest(VERSION).total_bytes
    chain = [relays(up_bytes_per_s=m / 2), relays(up_bytes_per_s=m / 2)]  # ~2 s per hop
    joined = {}

    def join_late():
        while chain[1].status()["versions"].get(str(VERSION), {}).get("have", 0) < 5:
            time.sleep(0.01)
        leaf = relays()
        joined["leaf_had"] = chain[1].status()["versions"][str(VERSION)]
        srcs = sources_for(chain[1].url, [chain[0].url], store.spec)
        joined["result"] = leaf.fetch(VERSION, srcs, timeout=120)
        joined["relay"] = leaf

    late = threading.Thread(target=join_late)
    late.start()
    chain_fetch(chain, store.spec)
    late.join()
    assert not joined["leaf_had"].get("complete"), joined["leaf_had"]  # really mid-broadcast
    assert_same(store, joined["relay"])
    result = joined["result"]
    assert not result.reports
    assert result.bytes_from_store < 4096
    assert result.bytes_by_source[chain[1].url] > m * 0.99


def test_origin_serves_one_copy_for_a_chain(store, relays):
    """The store's uplink modelled as an origin relay: a chain of 5 costs it one copy."""
    origin = relays(up_bytes_per_s=20e6)
    origin.fetch(VERSION, [store.spec])
    chain = [relays(up_bytes_per_s=20e6) for _ in range(5)]
    chain_fetch(chain, origin.url)
    keys = [k.decode() for k in store.kv.list().result()]
    stored = sum(len(store.kv.read(k).result().value) for k in keys if "/c/" in k)  # padded
    manifest = len(store.kv.read(LAYOUT.manifest_key(VERSION)).result().value)
    # Every chunk exactly once, plus the manifest once per relay (from the root of trust).
    assert origin.bytes_up == stored + 5 * manifest
    for r in chain:
        assert_same(store, r)


def test_relay_is_a_read_only_http_kvstore(store, relays):
    relay = relays()
    relay.fetch(VERSION, [store.spec])
    spec = {
        "driver": "http",
        "base_url": relay.url + "/kv/",
        "path": LAYOUT.array_prefix(VERSION, "a"),
    }
    arr = ts.open({"driver": "zarr3", "kvstore": spec}, open=True).result()
    assert np.array_equal(arr.read().result(), store.read_all(VERSION)["a"])


def test_relay_keeps_the_newest_versions(store, relays):
    relay = relays(keep_versions=1)
    relay.fetch(VERSION, [store.spec])
    store.publish(VERSION + 1, 2, [("a", np.ones((4, 4), np.float32))], {}, dtype="bfloat16")
    relay.fetch(VERSION + 1, [store.spec])
    assert relay.store.versions() == [VERSION + 1]


def test_a_chunk_rotted_in_a_relays_cache_is_never_served(store, relays):
    parent, child = relays(), relays()
    parent.fetch(VERSION, [store.spec])
    key = next(k for k in parent.versions[VERSION].plan if "/a/" in k)
    raw = parent.mirror.kv.read(key).result().value
    parent.mirror.kv.write(key, b"\0" + raw[1:]).result()  # bit rot after verification
    result = child.fetch(VERSION, sources_for(parent.url, [], store.spec), timeout=60)
    assert_same(store, child)
    assert ("http://" in result.reports[0]["source"]) and result.reports[0]["kind"] == "dead"
    assert VERSION not in parent.store.versions()  # dropped: the next fetch starts over
    parent.fetch(VERSION, [store.spec])
    assert_same(store, parent)


def test_peer_swap_follows_the_route_and_reports(store, relays):
    from bridge.control.protocol import Heartbeat, HeartbeatResponse, VersionAnnouncement
    from rollout_gpu.peer_swap import PeerSwap

    parent = relays()
    parent.fetch(VERSION, [store.spec])
    ann = VersionAnnouncement(version=VERSION, store=store.spec)
    swap = PeerSwap()
    try:
        got = swap.store_for(ann)  # store mode: today's path, reported once read
        assert got.read_all(VERSION).keys() == store.read_all(VERSION).keys()
        rep = Heartbeat(worker_version=-1, **swap.heartbeat_fields()).broadcast
        assert rep.version == VERSION and rep.bytes_from_store > 0 and not rep.bytes_from_peers

        swap.note_route(HeartbeatResponse(announcement=ann, broadcast_mode="chain",
                                          relay_parent=parent.url))  # fmt: skip
        deadline = time.monotonic() + 30  # the route's announcement starts a prefetch
        while VERSION not in swap.relay.store.versions():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert swap.store_for(ann) is swap.relay.store
        assert_same(store, swap.relay)
        hb = Heartbeat(worker_version=-1, **swap.heartbeat_fields())
        assert hb.relay_url == swap.url and hb.down_bytes_per_s > 0
        assert hb.broadcast.bytes_from_peers > 0 and hb.broadcast.bytes_from_store < 4096
    finally:
        swap.close()


def test_peer_swap_corrupt_report_names_a_bad_chunk(store, relays):
    """The worker's heartbeat says which chunk its parent served corrupt (the controller
    re-verifies that chunk: bridge/broadcast/report_check.py)."""
    from bridge.control.protocol import Heartbeat, HeartbeatResponse, VersionAnnouncement
    from rollout_gpu.peer_swap import PeerSwap

    bad = set()

    def tamper(key, body):
        if "/c/" in key:
            bad.add(key)
            return bytes([body[0] ^ 0xFF]) + body[1:]
        return body

    parent = relays(tamper=tamper)
    parent.fetch(VERSION, [store.spec])
    ann = VersionAnnouncement(version=VERSION, store=store.spec)
    swap = PeerSwap()
    try:
        swap.note_route(HeartbeatResponse(announcement=ann, broadcast_mode="chain",
                                          relay_parent=parent.url))  # fmt: skip
        deadline = time.monotonic() + 30
        while VERSION not in swap.relay.store.versions():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert_same(store, swap.relay)  # every chunk came from the store instead
        rep = Heartbeat(worker_version=-1, **swap.heartbeat_fields()).broadcast
        [corrupt] = [b for b in rep.bad_sources if b.kind == "corrupt"]
        assert corrupt.source == parent.url and corrupt.key in bad
    finally:
        swap.close()


def test_full_size_chunks_are_stored_raw_and_relayed(tmp_path, relays, monkeypatch):
    """With the store's default 4 MiB chunks tensorstore would shard each chunk (an index
    after the data) unless the codecs are explicit; relays verify the raw keys, so every
    chunk was refused and a real model never moved peer to peer."""
    monkeypatch.setattr(chunk_digest, "CHUNK_BYTES", 4 << 20)  # the store's default
    s = WeightStore(str(tmp_path / "store"))
    w = np.random.default_rng(1).standard_normal((4096, 1024)).astype(np.float32)
    s.publish(1, 1, [("w", w)], {}, dtype="bfloat16")  # 8 MiB: two 4 MiB chunks
    meta = json.loads((tmp_path / "store" / "data" / f"{1:012d}" / "w" / "zarr.json").read_text())
    assert meta["codecs"] == [{"name": "bytes", "configuration": {"endian": "little"}}]
    chain = [relays(), relays()]
    results = chain_fetch(chain, s.spec, version=1)
    assert not results[1].reports and results[1].bytes_from_store < 4096
    got = chain[1].store.read_all(1)["w"]
    assert np.array_equal(got.view(np.uint16), s.read_all(1)["w"].view(np.uint16))
