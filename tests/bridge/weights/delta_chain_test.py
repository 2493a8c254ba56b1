"""Delta versions on a real file store: bit-exact chains, path choice, tampering, retention.

The reference is plain numpy: the weights each version should have, built by the test
itself; every read is compared byte for byte (uint16 views of bf16) with it.
"""

import ml_dtypes
import numpy as np
import pytest

from bridge.store.layout import LAYOUT
from bridge.store.manifest import CorruptVersionError, VersionNotFoundError
from bridge.store.weight_store import WeightStore
from bridge.weights import delta_codec as codec
from bridge.weights.delta_publisher import DeltaPublisher
from bridge.weights.delta_reconstruct import choose_path, links, reconstruct

SHAPES = {"embed": (512, 64), "q": (64, 64), "norm": (64,), "big": (1024, 128)}
CONFIG = {"note": "not a real model"}


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint16)


def _step(weights, rng, version):
    """Next version: a few % of elements move, `norm` is untouched on odd versions, `q`
    changes densely every 5th version (the dense fallback), values incl. -0.0 vs 0.0."""
    out = {}
    for name, w in weights.items():
        frac = 0.6 if (name == "q" and version % 5 == 0) else 0.03
        if name == "norm" and version % 2:
            frac = 0.0
        new = w.copy()
        mask = rng.random(w.shape) < frac
        new[mask] = rng.standard_normal(int(mask.sum())).astype(ml_dtypes.bfloat16)
        out[name] = new
    if version == 3:  # a sign-of-zero flip is a byte change too
        out["norm"] = out["norm"].copy()
        out["norm"][0], weights["norm"][0] = -0.0, 0.0
    return out


def _initial(seed=0):
    rng = np.random.default_rng(seed)
    return {n: rng.standard_normal(s).astype(ml_dtypes.bfloat16) for n, s in SHAPES.items()}


@pytest.fixture
def store(tmp_path):
    return WeightStore(str(tmp_path / "store"))


def _publish_run(store, n, anchor_every=6, max_density=0.3, seed=0):
    rng = np.random.default_rng(seed)
    pub = DeltaPublisher(store, anchor_every=anchor_every, max_density=max_density)
    weights, reference = _initial(seed), {}
    for v in range(n):
        if v:
            weights = _step(weights, rng, v)
        pub.publish(v, v, weights.items(), CONFIG, "bfloat16")
        reference[v] = {k: a.copy() for k, a in weights.items()}
    return pub, reference


def test_codec_roundtrip_and_refuses_malformed():
    rng = np.random.default_rng(1)
    base = rng.standard_normal(10_000).astype(ml_dtypes.bfloat16)
    new = base.copy()
    idx = np.sort(rng.choice(10_000, 300, replace=False))
    new[idx] = rng.standard_normal(300).astype(ml_dtypes.bfloat16)
    got = codec.changed_indices(base, new)
    assert set(got) <= set(idx)  # a redraw can hit the same bf16 value
    for compress in (False, True):
        blob = codec.encode_patch(got, new[got], compress)
        i, v = codec.decode_patch(blob, new.size, new.dtype)
        assert (_bits(codec.apply_patch(base, i, v)) == _bits(new)).all()
        with pytest.raises(codec.PatchError):
            codec.decode_patch(blob, int(got[-1]), new.dtype)  # an index outside the tensor
        with pytest.raises(codec.PatchError):
            codec.decode_patch(blob[:-3], new.size, new.dtype)  # torn
    raw = bytearray(codec.encode_patch(np.array([5, 9]), new[[5, 9]], compress=False))
    raw[17] = 0  # header 16 bytes, one-byte gaps: the second gap 0, indices not increasing
    with pytest.raises(codec.PatchError, match="increasing"):
        codec.decode_patch(bytes(raw), new.size, new.dtype)


def test_twenty_versions_bit_exact_with_dense_fallbacks_and_anchors(store):
    pub, reference = _publish_run(store, 20)
    kinds = {"same": 0, "patch": 0, "dense": 0}
    anchors = []
    for v in range(20):
        manifest = store.manifest(v)
        if manifest.is_full:
            anchors.append(v)
        assert (manifest.delta is None) == (v == 0)  # anchors after 0 carry a patch too
        if v:
            assert manifest.delta.base == v - 1 and manifest.delta.anchor == anchors[-1]
            for p in manifest.delta.tensors.values():
                kinds[p.kind] += 1
        # A fresh reader (no copy in hand): anchor + every delta, verified.
        got = store.read_all(v)
        for name, want in reference[v].items():
            assert (_bits(got[name]) == _bits(want)).all(), (v, name)
    assert anchors == [0, 6, 12, 18]  # anchor_every=6
    assert all(kinds.values()), kinds  # unchanged, patched and dense tensors all occurred
    # A reader on an anchor's predecessor crosses the anchor by its patch (the anchor skip).
    got = reconstruct(store, 13, have=(11, reference[11]))
    assert got.path == [12, 13] and got.bytes_read < store.manifest(12).total_bytes / 4
    assert all((_bits(got.tensors[n]) == _bits(reference[13][n])).all() for n in SHAPES)
    # Without a copy in hand: anchor 12 whole, then 13's patch.
    assert reconstruct(store, 13).bytes_read > store.manifest(12).total_bytes


def test_stored_bytes_are_a_fraction_of_full(store):
    _publish_run(store, 5, anchor_every=100)
    m = store.manifest(4)
    assert m.delta.nbytes < 0.2 * m.total_bytes  # 3% of elements moved (q dense at v=5 only)
    assert 0.01 < m.delta.density < 0.05


def test_catch_up_after_missing_seven_takes_the_cheaper_path(store):
    _, reference = _publish_run(store, 14, anchor_every=6, max_density=0.3)
    # On 2, target 9 (anchor 6 between): 7 hops of patches beat anchor 6 whole + 3 patches.
    got = reconstruct(store, 9, have=(2, reference[2]))
    chain = links(store, 9, 2)  # 2's own manifest is not read: the reader holds 2
    assert [m.version for m in chain] == list(range(3, 10))
    assert got.path == list(range(3, 10))
    assert got.bytes_read == sum(m.delta.nbytes for m in chain)
    assert got.bytes_read < store.manifest(6).total_bytes
    assert all((_bits(got.tensors[n]) == _bits(reference[9][n])).all() for n in SHAPES)
    assert got.changed == set(SHAPES)  # every tensor moved at some point in 7 versions
    # When the hops outweigh the anchor (priced heavier here), the anchor path wins.
    heavy = [m.model_copy(update={"delta": m.delta.model_copy(update={"nbytes": 10**12})})
             if m.version == 4 else m for m in chain]  # fmt: skip
    from_full, path = choose_path(heavy, 2)
    assert from_full and [m.version for m in path] == [6, 7, 8, 9]
    # A late joiner (no copy) takes the anchor.
    assert reconstruct(store, 9).path == [6, 7, 8, 9]
    # One version on: only tensors whose patch is not empty are "changed" (the reload set).
    one = reconstruct(store, 9, have=(8, reference[8]))
    assert one.path == [9]
    assert one.changed == {
        n for n, p in store.manifest(9).delta.tensors.items() if p.kind != "same"
    }


def test_tampered_patch_and_base_are_refused(store):
    _, reference = _publish_run(store, 4, anchor_every=100)
    key = LAYOUT.patch_key(3, "embed")
    blob = bytearray(store.kv.read(key).result().value)
    blob[-1] ^= 1
    store.kv.write(key, bytes(blob)).result()
    with pytest.raises(CorruptVersionError, match="patch of embed"):
        reconstruct(store, 3, have=(2, reference[2]))
    # The reader's base is corrupt (one bit in memory): the rebuilt tensor fails its digest.
    base = {k: a.copy() for k, a in reference[1].items()}
    base["big"].view(np.uint16)[7] ^= 1
    with pytest.raises(CorruptVersionError, match="reconstructed big"):
        reconstruct(store, 2, have=(1, base))
    # A tampered anchor chunk: store.read verifies the anchor's chunks.
    anchor_chunk = LAYOUT.chunk_key(0, "q", (0, 0))
    data = bytearray(store.kv.read(anchor_chunk).result().value)
    data[0] ^= 1
    store.kv.write(anchor_chunk, bytes(data)).result()
    with pytest.raises(CorruptVersionError):
        store.read_all(2)


def test_fresh_publisher_anchors_and_gc_keeps_the_chain(store):
    pub, reference = _publish_run(store, 5, anchor_every=100)
    # A restarted learner: a new publisher remembers nothing, so its first version is full.
    again = DeltaPublisher(store, anchor_every=100, max_density=0.3)
    again.publish(5, 5, reference[4].items(), CONFIG, "bfloat16")
    assert store.manifest(5).delta is None and again.last.anchor
    again.publish(6, 6, reference[4].items(), CONFIG, "bfloat16")
    assert store.manifest(6).delta.base == 5 and store.manifest(6).delta.nbytes == 0
    # keep=2 keeps 5 and 6; 0..4 go. keep=3 with 4 kept needs its chain back to anchor 0.
    assert store.gc(3) == []  # 4 is a delta on 3 ... on 0: all stay
    assert store.gc(2) == [0, 1, 2, 3, 4]
    with pytest.raises(VersionNotFoundError):
        store.manifest(4)
    assert (_bits(store.read_all(6)["big"]) == _bits(reference[4]["big"])).all()


def test_relay_plans_of_anchors_and_deltas_are_checked_per_key(store):
    """What a relay moves of a version (bridge/broadcast/chunks.py): an anchor whole (every
    chunk, plus its patch on the previous version) or as its hop; a delta version's patches
    (checked against the manifest's BLAKE3 digest of the patch object) and dense tensors'
    chunks (the full tensor's chunk digests). A flipped byte fails its key's check."""
    from bridge.broadcast import chunks

    _publish_run(store, 11, anchor_every=6)
    anchor = chunks.chunk_plan(6, store.manifest(6))  # an anchor carrying its patch on 5
    assert {s.array for s in anchor if not s.patch} == set(SHAPES)
    assert {s.key for s in anchor if s.patch} == {
        LAYOUT.patch_key(6, n) for n, p in store.manifest(6).delta.tensors.items()
        if p.kind == "patch"
    }  # fmt: skip
    hop = chunks.chunk_plan(6, store.manifest(6), whole=False)
    assert {s.key for s in hop} < {s.key for s in anchor}
    m10 = store.manifest(10)  # q went dense at 10 (every 5th version)
    delta = chunks.chunk_plan(10, m10)
    assert m10.delta.tensors["q"].kind == "dense"
    assert {s.array for s in delta if not s.patch} == {"q"}
    assert sum(s.nbytes for s in delta) == m10.delta.nbytes
    for spec in anchor + delta:
        raw = store.kv.read(spec.key).result().value
        assert chunks.chunk_ok(spec, raw)
        assert not chunks.chunk_ok(spec, bytes([raw[0] ^ 1]) + raw[1:])
        assert chunks.chunk_ok(spec, None) == (not spec.patch and not any(raw))
    with pytest.raises(ValueError, match="delta version"):
        chunks.chunk_plan(10, m10, whole=True)
    with pytest.raises(ValueError, match="without a patch"):
        chunks.chunk_plan(0, store.manifest(0), whole=False)


def test_patch_pieces_that_cannot_cover_the_patch_are_refused():
    """A manifest entry whose pieces do not add up to the patch is an error when read."""
    from bridge.store.manifest import TensorPatch

    ok = TensorPatch(
        kind="patch", changed=5, nbytes=100, digest="d", pieces=("a", "b", "c"), piece_nbytes=40
    )
    assert [n for _, _, n in ok.objects(7, "w")] == [40, 40, 20]
    assert [k for k, _, _ in ok.objects(7, "w")] == [
        LAYOUT.patch_piece_key(7, "w", i) for i in range(3)
    ]
    for bad in (
        {"pieces": ("a", "b"), "piece_nbytes": 40},  # 80 bytes of pieces for a 100-byte patch
        {"pieces": ("a", "b", "c"), "piece_nbytes": 0},
        {"pieces": ("a",), "piece_nbytes": 100},  # one piece: the plain object, not pieces
    ):
        with pytest.raises(ValueError, match="cannot hold"):
            TensorPatch(kind="patch", changed=5, nbytes=100, digest="d", **bad)
