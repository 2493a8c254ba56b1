"""The patch of one tensor: which stored elements changed vs the base version, and their values.

A patch REPLACES elements, it never adds: applying it to the base's stored bytes gives the
new version's stored bytes exactly, so a chain of patches reconstructs bit-exactly (adding
bf16 differences would round). "Changed" compares stored bytes (the dtype viewed as
unsigned ints), so -0.0 vs 0.0 and NaN payloads count as changes too.

Stored object (`LAYOUT.patch_key`; above the store's chunk size it is stored in pieces,
`TensorPatch.pieces`, and this is their concatenation), little-endian:

    b"DPT1"  u8 gap_width (1, 2, 4 or 8)  u8 zstd (0/1)  u16 reserved (0)  u64 count
    body:    count gaps (u{8*gap_width}): index[0], then index[i] - index[i-1] (> 0)
             count values (the stored dtype's bytes)
             the body zstd-compressed when zstd == 1

Sorted index gaps are small (a few percent of elements change, spread out), so most fit
in one or two bytes; zstd then squeezes what is left (`bench.delta` reports what it buys).
A patch larger than its tensor is not written: the tensor goes dense (`encode`).
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np

MAGIC = b"DPT1"
_HEADER = struct.Struct("<4sBBHQ")
_GAP_DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
ZSTD_LEVEL = 3  # level 3: ~all of the ratio of level 9 here at several times the speed


class PatchError(ValueError):
    """A patch object that cannot be a patch of this tensor (torn, tampered, mismatched)."""


def _bits(array: np.ndarray) -> np.ndarray:
    """The stored bytes of an array as flat unsigned ints (bf16/f16 -> u16, f32 -> u32)."""
    flat = np.ascontiguousarray(array).reshape(-1)
    return flat.view(np.dtype(f"<u{flat.dtype.itemsize}"))


def changed_indices(base: np.ndarray, new: np.ndarray) -> np.ndarray:
    """Flat indices (int64, ascending) whose stored bytes differ between two arrays."""
    if base.shape != new.shape or base.dtype != new.dtype:
        raise ValueError(f"cannot diff {base.dtype}{base.shape} against {new.dtype}{new.shape}")
    return np.flatnonzero(_bits(base) != _bits(new))


def encode_patch(indices: np.ndarray, values: np.ndarray, compress: bool | None = True):
    """The stored object of a patch: sorted flat `indices` get `values` (stored dtype)."""
    indices = np.asarray(indices, np.int64)
    gaps = np.diff(indices, prepend=0).astype(np.uint64)
    width = next(
        w for w, t in _GAP_DTYPES.items() if not gaps.size or gaps.max() <= np.iinfo(t).max
    )
    body = gaps.astype(_GAP_DTYPES[width]).tobytes() + np.ascontiguousarray(values).tobytes()
    if compress is None:  # the size without zstd (what `bench.delta` compares against)
        return _HEADER.size + len(body)
    if compress:
        import zstandard

        body = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(body)
    return _HEADER.pack(MAGIC, width, int(compress), 0, len(indices)) + body


def decode_patch(blob: bytes, size: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(flat indices, values) of a patch of a tensor with `size` elements of `dtype`.

    Raises PatchError unless the object is a well-formed patch of such a tensor: strictly
    increasing indices inside the tensor, exactly `count` values."""
    dtype = np.dtype(dtype)
    if len(blob) < _HEADER.size:
        raise PatchError(f"patch of {len(blob)} bytes is shorter than its header")
    magic, width, compressed, reserved, count = _HEADER.unpack_from(blob)
    if magic != MAGIC or width not in _GAP_DTYPES or compressed not in (0, 1) or reserved:
        raise PatchError("not a patch object (bad magic or header fields)")
    if count > size:
        raise PatchError(f"patch changes {count} elements of a tensor of {size}")
    body = memoryview(blob)[_HEADER.size :]
    expected = count * (width + dtype.itemsize)
    if compressed:
        import zstandard

        try:
            body = zstandard.ZstdDecompressor().decompress(body, max_output_size=expected)
        except zstandard.ZstdError as e:
            raise PatchError(f"patch body does not decompress: {e}") from e
    if len(body) != expected:
        raise PatchError(f"patch body is {len(body)} bytes, {count} elements need {expected}")
    gaps = np.frombuffer(body, _GAP_DTYPES[width], count).astype(np.int64)
    if count and (gaps[1:] <= 0).any():
        raise PatchError("patch indices are not strictly increasing")
    indices = np.cumsum(gaps)
    if count and not 0 <= indices[-1] < size:  # gaps > 0 and no overflow: all in range
        raise PatchError(f"patch index {indices[-1]} outside a tensor of {size} elements")
    values = np.frombuffer(body, dtype, count, offset=count * width)
    return indices, values


def apply_patch(base: np.ndarray, indices: np.ndarray, values: np.ndarray) -> np.ndarray:
    """A new array: `base` with the flat `indices` replaced by `values` (base untouched)."""
    out = np.empty(base.shape, base.dtype)
    _bits(out)[:] = _bits(base)  # copied as uints: a bf16 array copy is ~10x slower
    patch_in_place(out, indices, values)
    return out


def patch_in_place(array: np.ndarray, indices: np.ndarray, values: np.ndarray) -> None:
    """Replace the flat `indices` of a C-contiguous `array` by `values`, as raw bytes
    (numpy's fancy indexing on ml_dtypes' bfloat16 runs an element-wise Python-level copy,
    ~10x slower than on the same bits as uint16)."""
    _bits(array)[indices] = _bits(values)


@dataclasses.dataclass(frozen=True)
class Encoded:
    """One tensor of a delta version: kind "same" | "patch" | "dense", and the patch."""

    kind: str
    changed: int
    blob: bytes | None = None
    raw_nbytes: int = 0  # the patch's size without zstd


def encode(base: np.ndarray, new: np.ndarray, max_density: float, compress: bool = True):
    """How to store `new` given the reader has `base`: nothing, a patch, or the whole tensor
    (more than `max_density` of its elements changed, or the patch would not be smaller)."""
    indices = changed_indices(base, new)
    if not indices.size:
        return Encoded("same", 0)
    if indices.size > max_density * new.size:
        return Encoded("dense", int(indices.size))
    values = _bits(new)[indices]  # the stored bytes (uint view: fast gather, same bytes)
    blob = encode_patch(indices, values, compress)
    if len(blob) >= new.nbytes:
        return Encoded("dense", int(indices.size))
    raw = encode_patch(indices, values, None) if compress else len(blob)
    return Encoded("patch", int(indices.size), blob, raw)
