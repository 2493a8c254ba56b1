"""The store's key layout: the literal keys (a store written today must stay readable), and
that every key a version writes parses back to that version and falls in its ranges."""

import numpy as np

from bridge.store.layout import LAYOUT
from bridge.store.weight_store import WeightStore


def test_keys_are_the_published_layout():
    assert LAYOUT.manifest_key(7) == "manifests/000000000007.json"
    assert LAYOUT.data_prefix(7) == "data/000000000007/"
    assert LAYOUT.array_prefix(7, "model.norm.weight") == "data/000000000007/model.norm.weight/"
    assert LAYOUT.chunk_key(7, "w", (3, 0)) == "data/000000000007/w/c/3/0"
    assert LAYOUT.part_key(7, 2) == "data/000000000007/.parts/00002.json"
    assert LAYOUT.manifest_range() == ("manifests/", "manifests0")
    assert LAYOUT.data_range(2, 5) == ("data/000000000002", "data/000000000005")


def test_version_of_parses_only_keys_of_the_layout():
    for key in [
        LAYOUT.manifest_key(12),
        LAYOUT.data_prefix(12),
        LAYOUT.array_prefix(12, "w") + "zarr.json",
        LAYOUT.chunk_key(12, "w", (0, 1)),
        LAYOUT.part_key(12, 0),
    ]:
        assert LAYOUT.version_of(key) == 12, key
    for key in ["manifests/x.json", "manifests/12", "data/12", "data/x/w", "other/12/w", ""]:
        assert LAYOUT.version_of(key) is None, key
    assert LAYOUT.listed_version("000000000012.json") == 12
    assert LAYOUT.listed_version("000000000012.json.tmp") is None


def test_every_stored_key_of_a_version_lies_in_its_ranges(tmp_path):
    store = WeightStore(f"file://{tmp_path}")
    for v in (1, 2, 3):
        store.publish(v, v, [("w", np.ones((4, 4), np.float32))], {})
    keys = [k.decode() for k in store.kv.list().result()]
    lo, hi = LAYOUT.data_range(2, 3)
    for key in keys:
        v = LAYOUT.version_of(key)
        assert v in (1, 2, 3), key
        if key.startswith(LAYOUT.data):
            assert (lo <= key < hi) == (v == 2), key
    assert LAYOUT.chunk_key(2, "w", (0, 0)) in keys
    assert LAYOUT.manifest_key(2) in keys
