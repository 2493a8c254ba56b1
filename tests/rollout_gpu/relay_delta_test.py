"""Delta versions through the peer relays (real HTTP on loopback, no vLLM): a worker's relay
behind a parent catches up by the patches only, a late joiner by the anchor, and a tampered
patch served by the parent is refused on arrival, reported, and fetched from the store.

The reference is plain numpy: every rebuilt tensor is compared byte for byte (uint16 views
of bf16) with the weights the test published.
"""

import time

import ml_dtypes
import numpy as np
import pytest

from bridge.control.protocol import Heartbeat, HeartbeatResponse, VersionAnnouncement
from bridge.store import chunk_digest
from bridge.store.layout import LAYOUT
from bridge.store.manifest import CorruptVersionError
from bridge.store.weight_store import WeightStore
from bridge.weights.delta_publisher import DeltaPublisher
from bridge.weights.delta_reconstruct import reconstruct
from rollout_gpu.peer_swap import PeerSwap

SHAPES = {"embed": (2048, 256), "q": (256, 256), "norm": (256,)}


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint16)


def _publish_chain(store, versions):
    """Versions 0..versions-1 (anchors 0 and 6): 2% of elements move a version, `q` goes
    dense every 5th. Returns {version: the tensors published}."""
    pub = DeltaPublisher(store, anchor_every=6, max_density=0.3)
    rng = np.random.default_rng(0)
    w = {n: rng.standard_normal(s).astype(ml_dtypes.bfloat16) for n, s in SHAPES.items()}
    ref = {}
    for v in range(versions):
        if v:
            w = {n: a.copy() for n, a in w.items()}
            for n, a in w.items():
                mask = rng.random(a.shape) < (0.6 if n == "q" and v % 5 == 0 else 0.02)
                a[mask] = rng.standard_normal(int(mask.sum())).astype(ml_dtypes.bfloat16)
        pub.publish(v, v, w.items(), {}, "bfloat16")
        ref[v] = w
    return ref


@pytest.fixture
def chain(tmp_path, monkeypatch):
    """Versions 0..10 of `_publish_chain`; 64 KiB chunks so the embedding is 16 of them
    (and every patch one object)."""
    monkeypatch.setattr(chunk_digest, "CHUNK_BYTES", 64 << 10)
    store = WeightStore(str(tmp_path / "store"))
    return store, _publish_chain(store, 11)


def _worker_relay(store, parent, have, version):
    """A worker's PeerSwap serving `have`, routed to `parent`, told of `version`."""
    swap = PeerSwap(keep_versions=2, stall_s=10)
    swap.have = lambda: have
    ann = VersionAnnouncement(version=version, store=store.spec, published_at=1.0)
    swap.note_route(HeartbeatResponse(announcement=ann, broadcast_mode="chain",
                                      relay_parent=parent.url))  # fmt: skip
    return swap, swap.store_for(ann)


def _report(swap):
    return Heartbeat(worker_version=-1, **swap.heartbeat_fields()).broadcast


def _manifest_bytes(store, versions):
    return sum(len(store.kv.read(LAYOUT.manifest_key(v)).result().value) for v in versions)


def test_a_worker_behind_a_relay_catches_up_by_patches(chain, relays):
    store, ref = chain
    parent = relays(keep_versions=16)
    for v in range(11):  # the parent followed every version: 0 whole, then hops (6 whole)
        parent.fetch(v, [store.spec], timeout=60)
    assert not parent.versions[3].plan.keys() & {  # a hop holds no chunk of a patched tensor
        LAYOUT.chunk_key(3, "embed", (0, 0))
    }
    hops = [store.manifest(v) for v in range(2, 9)]
    swap, got_store = _worker_relay(store, parent, have=1, version=8)  # missed 7 versions
    try:
        assert got_store is swap.relay.store
        assert sorted(swap.relay.store.versions()) == list(range(2, 9))  # pinned: all kept
        got = reconstruct(got_store, 8, have=(1, ref[1]))
        assert got.path == list(range(2, 9))  # across anchor 6 by its patch
        for n in SHAPES:
            assert (_bits(got.tensors[n]) == _bits(ref[8][n])).all(), n
        rep = _report(swap)
        assert rep.version == 8 and not rep.bad_sources
        # Only the hops' patches and dense tensors came, all from the parent; the store
        # served the manifests.
        assert rep.bytes_from_store == _manifest_bytes(store, range(2, 9))
        hop_bytes = sum(m.delta.nbytes for m in hops)
        assert hop_bytes <= rep.bytes_from_peers < hop_bytes + 16 * len(hops) * (64 << 10)
        assert rep.bytes_from_peers < store.manifest(6).total_bytes
    finally:
        swap.close()
    # A late joiner (no copy): anchor 6 whole, then 7 and 8, again through the parent.
    late, got_store = _worker_relay(store, parent, have=None, version=8)
    try:
        got = reconstruct(got_store, 8)
        assert got.path == [6, 7, 8]
        for n in SHAPES:
            assert (_bits(got.tensors[n]) == _bits(ref[8][n])).all(), n
        rep = _report(late)
        assert rep.bytes_from_peers > store.manifest(6).total_bytes
        assert rep.bytes_from_store == _manifest_bytes(store, [6, 7, 8])
    finally:
        late.close()


def test_a_tampered_patch_from_the_relay_is_refused_and_fetched_from_the_store(chain, relays):
    store, ref = chain
    served = []

    def tamper(key, body):  # the parent flips a byte of every patch object it serves
        if f"/{LAYOUT.delta}/" in key:
            served.append(key)
            return body[:-1] + bytes([body[-1] ^ 0x01])
        return body

    parent = relays(keep_versions=16, tamper=tamper)
    for v in (8, 9):
        parent.fetch(v, [store.spec], timeout=60)
    swap, got_store = _worker_relay(store, parent, have=8, version=9)
    try:
        assert served  # the parent did serve its tampered patches
        rep = _report(swap)
        assert {(b.source, b.kind) for b in rep.bad_sources} == {(parent.url, "corrupt")}
        got = reconstruct(got_store, 9, have=(8, ref[8]))
        assert got.path == [9]
        for n in SHAPES:
            assert (_bits(got.tensors[n]) == _bits(ref[9][n])).all(), n
        for key in served:  # what the worker's relay holds (and serves on) is the store's
            want = store.kv.read(key).result().value
            assert swap.relay.mirror.kv.read(key).result().value == want
    finally:
        swap.close()


def test_a_relay_says_gone_for_what_it_will_not_hold(chain, relays):
    """A version older than the relay's newest that it never began, or a chunk of an
    anchor it holds as its patch only: 410 at once (the reader asks the next source and
    blames no one), not a wait for the stall timeout."""
    import urllib.error
    import urllib.request

    store, _ = chain
    parent = relays(keep_versions=16)
    parent.fetch(5, [store.spec], timeout=60)
    parent.fetch(6, [store.spec], timeout=60, whole=False)  # the anchor as its hop
    parent.fetch(7, [store.spec], timeout=60)
    for key in (LAYOUT.patch_key(3, "embed"), LAYOUT.chunk_key(6, "embed", (0, 0))):
        t0 = time.monotonic()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{parent.url}/kv/{key}?wait=20", timeout=30)
        assert e.value.code == 410 and time.monotonic() - t0 < 10
    swap, got_store = _worker_relay(store, parent, have=None, version=7)
    try:  # needs 6 whole: its chunks came from the store, the parent not blamed
        rep = _report(swap)
        assert not rep.bad_sources
        assert rep.bytes_from_store > store.manifest(6).total_bytes
        assert reconstruct(got_store, 7).path == [6, 7]
    finally:
        swap.close()


def test_a_patch_larger_than_a_chunk_crosses_the_relays_in_verified_pieces(
    tmp_path, monkeypatch, relays
):
    """8 KiB chunks: the embedding's patch (~30 KB) is stored as pieces, each a key with its
    own digest, so relays move and re-serve it piece by piece (pipelined like chunks). A
    parent that tampers with one piece is reported; only that piece comes from the store."""
    import urllib.request

    from bridge.store.chunk_digest import digest_bytes

    monkeypatch.setattr(chunk_digest, "CHUNK_BYTES", 8 << 10)
    store = WeightStore(str(tmp_path / "store"))
    ref = _publish_chain(store, 4)
    embed = store.manifest(3).delta.tensors["embed"]
    assert embed.kind == "patch" and embed.nbytes > 3 * (8 << 10)
    pieces = embed.objects(3, "embed")
    assert len(pieces) == len(embed.pieces) >= 4 and all(n <= 8 << 10 for _, _, n in pieces)
    assert not store.kv.read(LAYOUT.patch_key(3, "embed")).result().value  # pieces only
    bad_key = pieces[1][0]

    def tamper(key, body):  # the parent flips a byte of one piece of the embedding's patch
        return body[:-1] + bytes([body[-1] ^ 0x01]) if key == bad_key else body

    for parent_tamper in (None, tamper):
        parent = relays(keep_versions=16, tamper=parent_tamper)
        for v in range(4):
            parent.fetch(v, [store.spec], timeout=60)
        for key, digest, _ in pieces:  # the parent serves each piece as its own key
            body = urllib.request.urlopen(f"{parent.url}/kv/{key}", timeout=30).read()
            assert (digest_bytes(body) == digest) == (parent_tamper is None or key != bad_key)
        swap, got_store = _worker_relay(store, parent, have=1, version=3)
        try:
            got = reconstruct(got_store, 3, have=(1, ref[1]))
            assert got.path == [2, 3]
            for n in SHAPES:
                assert (_bits(got.tensors[n]) == _bits(ref[3][n])).all(), n
            for key, _, _ in pieces:  # the worker's relay holds the store's bytes
                want = store.kv.read(key).result().value
                assert swap.relay.mirror.kv.read(key).result().value == want
            rep = _report(swap)
            from_store = rep.bytes_from_store - _manifest_bytes(store, [2, 3])
            if parent_tamper is None:
                assert not rep.bad_sources and from_store == 0
            else:  # refused on arrival, blamed, and only that piece re-read from the store
                assert {(b.source, b.kind) for b in rep.bad_sources} == {(parent.url, "corrupt")}
                assert from_store == pieces[1][2]
        finally:
            swap.close()
        parent.stop()

    # A tampered piece in the store itself is refused by the reader, naming the patch.
    body = store.kv.read(bad_key).result().value
    store.kv.write(bad_key, body[:-1] + bytes([body[-1] ^ 0x01])).result()
    with pytest.raises(CorruptVersionError, match="patch of embed"):
        reconstruct(store, 3, have=(2, ref[2]))
