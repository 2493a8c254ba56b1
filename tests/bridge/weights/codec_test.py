"""The patch format of bridge/weights/delta_codec.py at its edges, found by mutation testing
(`make mutants MODULES=bridge/weights/delta_codec.py`): each header field refused on its own,
a patch of every element or of none, zstd frames without a content size, the gap width at
255, the dense/patch boundary, and what `encode` reports (kind, changed count, raw size)."""

import struct

import numpy as np
import pytest
import zstandard

from bridge.weights import delta_codec as codec

HEADER = struct.Struct("<4sBBHQ")  # written out: magic, gap width, zstd, reserved, count


def _header(blob):
    return HEADER.unpack_from(blob)


def test_changed_indices_refuses_a_shape_or_a_dtype_mismatch_alone():
    a = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match="cannot diff"):
        codec.changed_indices(a, np.zeros((3, 2), np.float32))
    with pytest.raises(ValueError, match="cannot diff"):
        codec.changed_indices(a, np.zeros((2, 3), np.int32))


@pytest.mark.parametrize(
    "field, value", [(0, b"XPT1"), (1, 3), (2, 2), (3, 1)], ids=["magic", "width", "zstd", "rsv"]
)
def test_each_header_field_is_checked_on_its_own(field, value):
    blob = codec.encode_patch(np.array([1, 3]), np.array([5, 6], np.float32), compress=False)
    fields = list(_header(blob))
    fields[field] = value
    bad = HEADER.pack(*fields) + blob[HEADER.size :]
    with pytest.raises(codec.PatchError, match="bad magic or header fields"):
        codec.decode_patch(bad, 8, np.float32)


@pytest.mark.parametrize("compress", [False, True])
def test_empty_patch_and_full_patch(compress):
    empty = codec.encode_patch(np.array([], np.int64), np.array([], np.float32), compress)
    if not compress:
        assert len(empty) == HEADER.size
    i, v = codec.decode_patch(empty, 4, np.float32)
    assert i.size == 0 and v.size == 0
    full = codec.encode_patch(np.arange(4), np.arange(4, dtype=np.float32) + 1, compress)
    i, v = codec.decode_patch(full, 4, np.float32)  # count == size: every element changes
    np.testing.assert_array_equal(i, np.arange(4))
    np.testing.assert_array_equal(v, [1, 2, 3, 4])


def test_zstd_frame_without_content_size_decodes():
    # A writer may stream its frame (no content size in the header): the reader bounds the
    # output by what `count` needs instead.
    idx, vals = np.array([2, 7]), np.array([1.5, -2.0], np.float32)
    plain = codec.encode_patch(idx, vals, compress=False)
    body = zstandard.ZstdCompressor(write_content_size=False).compress(plain[HEADER.size :])
    blob = HEADER.pack(b"DPT1", _header(plain)[1], 1, 0, 2) + body
    i, v = codec.decode_patch(blob, 8, np.float32)
    np.testing.assert_array_equal(i, idx)
    np.testing.assert_array_equal(v, vals)


def test_gap_width_is_the_smallest_that_holds_the_largest_gap():
    vals = np.ones(1, np.float32)
    assert _header(codec.encode_patch(np.array([255]), vals, False))[1] == 1
    assert _header(codec.encode_patch(np.array([256]), vals, False))[1] == 2


def test_zstd_is_the_default_and_off_when_asked():
    idx, vals = np.array([1]), np.ones(1, np.float32)
    assert _header(codec.encode_patch(idx, vals))[2] == 1
    base = np.zeros(1000, np.float32)
    new = base.copy()
    new[::10] = 1.0
    assert _header(codec.encode(base, new, 0.5).blob)[2] == 1
    assert _header(codec.encode(base, new, 0.5, compress=False).blob)[2] == 0


def test_encode_reports_kind_changed_and_raw_size():
    base = np.zeros(1000, np.float32)
    assert codec.encode(base, base.copy(), 0.5) == codec.Encoded("same", 0)
    new = base.copy()
    new[::4] = np.arange(250, dtype=np.float32) + 1  # density exactly 0.25: still a patch
    enc = codec.encode(base, new, 0.25)
    assert (enc.kind, enc.changed) == ("patch", 250)
    assert enc.raw_nbytes == HEADER.size + 250 * (1 + 4)  # gaps of 4 in one byte, f32 values
    assert codec.encode(base, new, 0.2) == codec.Encoded("dense", 250)
    i, v = codec.decode_patch(enc.blob, new.size, new.dtype)
    np.testing.assert_array_equal(codec.apply_patch(base, i, v), new)


def test_patch_as_large_as_the_tensor_goes_dense():
    # 9 float32 (36 bytes); 4 changes cost 16 + 4 * (1 + 4) = 36 bytes unzipped: not smaller.
    base = np.zeros(9, np.float32)
    new = base.copy()
    new[[0, 2, 4, 6]] = 1.0
    assert codec.encode(base, new, 0.5, compress=False) == codec.Encoded("dense", 4)
    new[6] = 0.0  # 3 changes: 31 bytes, a patch
    assert codec.encode(base, new, 0.5, compress=False).kind == "patch"
