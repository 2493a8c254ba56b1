"""Chunk grids and the piecewise checksum: any exact cover of an array gives the same digest,
and the digest is the documented one (stores written today stay verifiable)."""

import hashlib

import blake3
import ml_dtypes
import numpy as np
import pytest

from bridge.store.chunk_digest import (
    CHECKSUM_ALGORITHM,
    CHUNK_BYTES,
    ChunkWriter,
    array_checksum,
    chunk_shape,
    combine_digests,
    zarr3_metadata,
)


def test_chunk_shape_fits_the_budget_and_divides_the_shard():
    assert chunk_shape((64,), 4, None) == (64,)
    assert chunk_shape((151936, 1024), 2, None) == (CHUNK_BYTES // 2048, 1024)
    # Shard [75968, 512]: 4096 rows fit; the largest divisor of 75968 below that is 2374.
    rows, cols = chunk_shape((151936, 1024), 2, (75968, 512))
    assert (75968 % rows, cols) == (0, 512) and rows * cols * 2 <= CHUNK_BYTES
    # A prime shard height has no useful divisor: fall back to the budget, assemble in memory.
    assert chunk_shape((2 * 100003, 1024), 2, (100003, 1024)) == (2048, 1024)


def _random_cover(rng, shape):
    """Random axis-aligned boxes that cover `shape` exactly once (recursive splits)."""
    boxes, todo = [], [tuple((0, n) for n in shape)]
    while todo:
        box = todo.pop()
        dims = [d for d, (lo, hi) in enumerate(box) if hi - lo > 1]
        if not dims or rng.random() < 0.25:
            boxes.append(box)
            continue
        d = rng.choice(dims)
        cut = int(rng.integers(box[d][0] + 1, box[d][1]))
        todo += [
            box[:d] + ((box[d][0], cut),) + box[d + 1 :],
            box[:d] + ((cut, box[d][1]),) + box[d + 1 :],
        ]
    rng.shuffle(boxes)
    return [tuple(slice(lo, hi) for lo, hi in b) for b in boxes]


@pytest.mark.parametrize("seed", range(5))
def test_checksum_is_independent_of_the_pieces(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((37, 23)).astype(ml_dtypes.bfloat16)
    chunks = (8, 23) if seed % 2 else (5, 7)
    writer, out = ChunkWriter("x", x.shape, chunks), np.zeros_like(x)
    for index in _random_cover(rng, x.shape):
        for idx, data in writer.add(index, x[index]):
            out[idx] = data
    assert writer.checksum() == array_checksum(x, chunks)
    np.testing.assert_array_equal(out.view(np.uint16), x.view(np.uint16))  # writes cover it


def test_checksum_sees_one_flipped_bit_and_a_moved_chunk():
    x = np.arange(64, dtype=np.float32).reshape(16, 4)
    ref = array_checksum(x, (4, 4))
    y = x.copy()
    y.view(np.uint32)[9, 2] ^= 1
    assert array_checksum(y, (4, 4)) != ref
    z = np.concatenate([x[4:8], x[:4], x[8:]])  # two chunks swapped
    assert array_checksum(z, (4, 4)) != ref


def test_checksum_is_sha256_of_blake3_chunk_digests_in_c_order():
    # Written out independently of the module: a change of digest, byte order or chunk
    # order is a new format (a new CHECKSUM_ALGORITHM), never a silent change.
    assert CHECKSUM_ALGORITHM == "blake3-chunks/sha256"
    x = np.arange(30, dtype=np.float32).reshape(5, 6)
    boxes = [x[0:2, 0:4], x[0:2, 4:6], x[2:4, 0:4], x[2:4, 4:6], x[4:5, 0:4], x[4:5, 4:6]]
    digests = [blake3.blake3(np.ascontiguousarray(b).tobytes()).digest() for b in boxes]
    want = hashlib.sha256(b"".join(digests)).hexdigest()
    assert array_checksum(x, (2, 4)) == want
    positions = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    by_position = {p: d.hex() for p, d in zip(positions, digests, strict=True)}
    assert combine_digests(dict(reversed(by_position.items()))) == want  # order by position


def test_bad_index_is_refused():
    w = ChunkWriter("x", (4, 4), (2, 4))
    with pytest.raises(ValueError, match="not all slices"):
        w.add((0, slice(None)), np.zeros((1, 4)))
    with pytest.raises(ValueError, match="bad piece slice"):
        w.add((slice(0, 4, 2), slice(None)), np.zeros((2, 4)))


def test_chunk_shape_edges():
    shapes = [
        ((4, 3 << 20), 2, None),  # one row is 6 MiB, over the budget: one row per chunk
        ((3 << 20,), 1, None),  # 1-byte elements: 4 Mi of them fit
        ((1, 4), 4, None),
        ((64, 1), 4, None),
        ((16384, 512), 2, (8192, 512)),  # the budget (4096 rows) divides the shard
        ((20000, 38130), 1, (10000, 38130)),  # 110 rows fit; 100 = sqrt(10000) divides
        ((201800, 4934), 1, (100900, 4934)),  # 850 fit; best divisor 100 is < 850 / 8
        ((201800, 5242), 1, (100900, 5242)),  # 800 fit; 100 is exactly 800 / 8: kept
        ((151936, 1024), 2, (75968, 512)),
    ]
    want = [(1, 3 << 20), (3 << 20,), (1, 4), (64, 1), (4096, 512), (100, 38130),
            (850, 4934), (100, 5242), (2374, 512)]  # fmt: skip
    for (shape, itemsize, block), w in zip(shapes, want, strict=True):
        got = chunk_shape(shape, itemsize, block)
        assert got == w, (shape, block)
        assert all(type(n) is int for n in got), got  # tensorstore takes integer shapes


def test_zarr3_metadata_stores_plain_chunk_bytes():
    # Relays verify a chunk's raw stored object against its digest: the codec must be plain
    # little-endian bytes (no sharding index, no compression).
    assert zarr3_metadata((6, 4), "bfloat16", (2, 4)) == {
        "shape": [6, 4],
        "data_type": "bfloat16",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2, 4]}},
        "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
    }


def test_aligned_piece_is_one_write_and_split_chunks_are_written_whole():
    x = np.arange(32, dtype=np.float32).reshape(8, 4)
    w = ChunkWriter("x", x.shape, (2, 4))
    # A piece made of whole chunks is written as it came, at its own place.
    writes = w.add((slice(4, 8), slice(None)), x[4:])
    assert [idx for idx, _ in writes] == [(slice(4, 8), slice(0, 4))]
    # A piece that ends inside a chunk holds it back until the rest of the chunk arrives;
    # then the chunk is written whole (concurrent writes of one chunk would race).
    writes = w.add((slice(None, 3), slice(None)), x[:3])
    assert [idx for idx, _ in writes] == [(slice(0, 2), slice(0, 4))]
    np.testing.assert_array_equal(writes[0][1], x[:2])
    writes = w.add((slice(3, 4), slice(None)), x[3:4])
    assert [idx for idx, _ in writes] == [(slice(2, 4), slice(0, 4))]
    np.testing.assert_array_equal(writes[0][1], x[2:4])
    assert w.checksum() == array_checksum(x, (2, 4))


def test_chunks_one_row_high():
    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    w = ChunkWriter("x", x.shape, (1, 4))
    w.add((slice(None), slice(None)), x)
    assert w.checksum() == array_checksum(x, (1, 4))  # row 0 is a chunk too


def test_empty_piece_is_accepted():
    w = ChunkWriter("x", (4, 4), (2, 4))
    writes = w.add((slice(2, 2), slice(None)), np.zeros((0, 4), np.float32))
    assert [(idx, data.shape) for idx, data in writes] == [((slice(2, 2), slice(0, 4)), (0, 4))]


def test_checksum_needs_every_chunk():
    x = np.arange(10, dtype=np.float32)  # 1-D: 3 chunks of 4
    w = ChunkWriter("x", x.shape, (4,))
    w.add((slice(0, 8),), x[:8])
    with pytest.raises(ValueError, match="cover 2 of 3 chunks"):
        w.checksum()
    w.add((slice(8, None),), x[8:])
    assert w.checksum() == array_checksum(x, (4,))


def test_piece_index_must_have_one_slice_per_dim():
    w = ChunkWriter("x", (4, 4), (2, 4))
    with pytest.raises(ValueError, match="is not 2 slices"):
        w.add((slice(None),), np.zeros((4, 4)))
    with pytest.raises(ValueError, match="is not 2 slices"):
        w.add(slice(None), np.zeros((4, 4)))
