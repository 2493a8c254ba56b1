"""One version written by several writers, each its own pieces (bridge/store/sharded_publish.py).

The writers here are calls in one process with disjoint row blocks of each array, as the
processes of a multi-host learner hand them in; tests/learner_jax/multihost/multihost_test.py runs
the real thing across processes. Checked against `WeightStore.publish` of the whole arrays:
same bytes, same checksums, and nothing is visible before the commit.
"""

import numpy as np
import pytest

from bridge.store import sharded_publish
from bridge.store.weight_store import ShardedSource, VersionExistsError, WeightStore

HF_CONFIG = {"model_type": "test"}


def _arrays():
    rng = np.random.default_rng(0)
    return {
        "a.weight": rng.standard_normal((8, 6)).astype(np.float32),
        "b.weight": rng.standard_normal((4,)).astype(np.float32),
    }


def _source(array, rows):
    """The pieces of `array` a writer holding row blocks `rows` (of 2 rows each) writes."""
    pieces = []
    for r in rows:
        index = (slice(2 * r, 2 * r + 2),) + tuple(slice(0, n) for n in array.shape[1:])
        pieces.append((index, array[index]))
    return ShardedSource(array.shape, pieces, (2, *array.shape[1:]))


def _publish(store, arrays, split, version=1, commit=True):
    """Writers p = 0..len(split)-1 write the row blocks split[p][name]."""
    layout = {n: (a.shape, (2, *a.shape[1:])) for n, a in arrays.items()}
    sharded_publish.begin(store, version, layout, "float32")
    written = [
        sharded_publish.write_part(
            store,
            version,
            p,
            [(n, _source(a, rows[n])) for n, a in arrays.items()],
            "float32",
        )
        for p, rows in enumerate(split)
    ]
    if commit:
        sharded_publish.commit(store, version, 7, len(split), HF_CONFIG, "float32", {"x": 1})
    return written


SPLIT = [{"a.weight": [0, 3], "b.weight": [1]}, {"a.weight": [1, 2], "b.weight": [0]}]


def test_two_writers_equal_one_publish(tmp_path):
    arrays = _arrays()
    multi, single = WeightStore(str(tmp_path / "multi")), WeightStore(str(tmp_path / "single"))
    written = _publish(multi, arrays, SPLIT)
    single.publish(
        1,
        7,
        [(n, _source(a, range(a.shape[0] // 2))) for n, a in arrays.items()],
        HF_CONFIG,
        "float32",
        {"x": 1},
    )
    got, want = multi.manifest(1), single.manifest(1)
    assert got.arrays == want.arrays and got.extra == want.extra == {"x": 1}
    for name, value in multi.read_all(1).items():
        np.testing.assert_array_equal(value, arrays[name])
    assert written[0]["a.weight"] == [[0, 0], [3, 0]] and written[1]["b.weight"] == [[0]]


def test_nothing_is_visible_before_the_commit(tmp_path):
    store = WeightStore(str(tmp_path))
    _publish(store, _arrays(), SPLIT, commit=False)
    assert store.versions() == []


@pytest.mark.parametrize(
    "split, match",
    [
        ([{"a.weight": [0, 1], "b.weight": [0, 1]}, {"a.weight": [2], "b.weight": []}], "cover"),
        ([{"a.weight": [0, 1, 3], "b.weight": [0]}, {"a.weight": [1, 2], "b.weight": [1]}], "two"),
    ],
)
def test_missing_or_doubled_chunks_are_refused(tmp_path, split, match):
    store = WeightStore(str(tmp_path))
    _publish(store, _arrays(), split, commit=False)
    with pytest.raises(ValueError, match=match):
        sharded_publish.commit(store, 1, 7, 2, HF_CONFIG, "float32")
    assert store.versions() == []


def test_a_missing_part_names_the_process(tmp_path):
    store = WeightStore(str(tmp_path))
    _publish(store, _arrays(), SPLIT[:1], commit=False)
    with pytest.raises(RuntimeError, match=r"processes \[1\] wrote no part"):
        sharded_publish.commit(store, 1, 7, 2, HF_CONFIG, "float32")
    assert store.versions() == []


def test_begin_refuses_an_existing_version_and_clears_debris(tmp_path):
    store = WeightStore(str(tmp_path))
    arrays = _arrays()
    _publish(store, arrays, SPLIT, version=2, commit=False)  # a crashed publish of 2
    _publish(store, arrays, SPLIT, version=2)  # rerun: debris gone, version complete
    assert store.versions() == [2]
    layout = {n: (a.shape, None) for n, a in arrays.items()}
    with pytest.raises(VersionExistsError):
        sharded_publish.begin(store, 2, layout, "float32")
    with pytest.raises(ValueError, match="not newer"):
        sharded_publish.begin(store, 1, layout, "float32")
