"""Chunk plans: every stored chunk checks against the manifest's per-chunk digests, and
altered bytes cannot pass, not even bytes forged to keep the chunk's CRC-32."""

import zlib

import numpy as np
import pytest

from bridge.broadcast import chunks
from bridge.store import chunk_digest
from bridge.store.layout import LAYOUT
from bridge.store.weight_store import WeightStore


@pytest.fixture
def published(monkeypatch, tmp_path):
    monkeypatch.setattr(chunk_digest, "CHUNK_BYTES", 4096)
    s = WeightStore(str(tmp_path))
    rng = np.random.default_rng(0)
    arrays = [("w", rng.standard_normal((100, 30)).astype(np.float32)), ("z", np.zeros(7))]
    return s, s.publish(0, 0, arrays, {}, dtype="bfloat16")


def test_plan_covers_every_stored_chunk_and_each_verifies(published):
    s, m = published
    plan = chunks.chunk_plan(0, m)
    stored = {k.decode() for k in s.kv.list().result() if b"/c/" in k}
    assert stored <= {c.key for c in plan}
    for c in plan:
        r = s.kv.read(c.key).result()
        raw = r.value if r.state == "value" else None  # all-zero chunks are not stored
        assert chunks.chunk_ok(c, raw), c.key
        if raw is not None:
            assert not chunks.chunk_ok(c, bytes([raw[0] ^ 1]) + raw[1:])
            assert not chunks.chunk_ok(c, raw[:-2])
    assert LAYOUT.version_of(plan[0].key) == 0


def test_digests_must_hash_to_the_checksum_and_be_present(published):
    _, m = published
    info = m.arrays["w"]

    def with_w(**update):
        return m.model_copy(update={"arrays": {**m.arrays, "w": info.model_copy(update=update)}})

    with pytest.raises(ValueError, match="chunk digests != checksum"):
        chunks.chunk_plan(0, with_w(chunk_digests=("00" * 32,) * len(info.chunk_digests)))
    with pytest.raises(chunks.MissingChunkDigests):
        chunks.chunk_plan(0, with_w(chunk_digests=None))
    crc_era = m.model_copy(update={"checksum_algorithm": "crc32-chunks/sha256"})
    with pytest.raises(chunks.MissingChunkDigests, match="crc32"):
        chunks.chunk_plan(0, crc_era)


def _forge_crc(data: bytes, target: int) -> bytes:
    """`data` with its last 4 bytes changed so that its CRC-32 is `target`: CRC is affine
    over GF(2), so the 32 bit flips of the tail span every CRC difference (Gauss-Jordan)."""
    n, zero = len(data), zlib.crc32(bytes(len(data)))
    basis: dict[int, tuple[int, int]] = {}  # top bit -> (CRC difference, tail bit flips)
    for bit in range(32):
        e = bytearray(n)
        e[n - 4 + bit // 8] = 1 << (bit % 8)
        v, flips = zlib.crc32(bytes(e)) ^ zero, 1 << bit
        while v and (v.bit_length() - 1) in basis:
            bv, bf = basis[v.bit_length() - 1]
            v, flips = v ^ bv, flips ^ bf
        if v:
            basis[v.bit_length() - 1] = (v, flips)
    v, flips = target ^ zlib.crc32(data), 0
    while v:
        bv, bf = basis[v.bit_length() - 1]
        v, flips = v ^ bv, flips ^ bf
    out = bytearray(data)
    for bit in range(32):
        if flips >> bit & 1:
            out[n - 4 + bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def test_a_chunk_forged_to_keep_its_crc32_is_refused(published):
    # What a hostile relay could do while chunks were checked by CRC-32.
    s, m = published
    spec = chunks.chunk_plan(0, m)[0]
    raw = s.kv.read(spec.key).result().value
    tampered = b"\x7f" * 16 + raw[16:]  # new weights in the first 8 bf16 values
    forged = _forge_crc(tampered, zlib.crc32(raw))
    assert zlib.crc32(forged) == zlib.crc32(raw) and forged != raw
    assert chunks.chunk_ok(spec, raw)
    assert not chunks.chunk_ok(spec, forged)
