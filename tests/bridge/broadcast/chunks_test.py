"""Chunk plans: every stored chunk checks against the manifest's per-chunk CRCs."""

import numpy as np
import pytest

from bridge.broadcast import chunks
from bridge.store import chunk_digest
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
    assert chunks.key_version(plan[0].key) == 0
    assert chunks.key_version(chunks.manifest_key(12)) == 12


def test_crcs_must_hash_to_the_checksum_and_be_present(published):
    _, m = published
    info = m.arrays["w"]
    forged = m.model_copy(
        update={"arrays": {**m.arrays, "w": info.model_copy(update={"chunk_crcs": (1,) * 8})}}
    )
    with pytest.raises(ValueError, match="do not match"):
        chunks.chunk_plan(0, forged)
    old = m.model_copy(
        update={"arrays": {**m.arrays, "w": info.model_copy(update={"chunk_crcs": None})}}
    )
    with pytest.raises(chunks.MissingChunkDigests):
        chunks.chunk_plan(0, old)
