"""Which keys make up a published version, and how to verify one chunk of it on its own.

A relay moves a version key by key, in the weight store's own layout (manifests/{v}.json,
data/{v}/{hf_name}/c/i/j), so a chunk can be re-served the moment it is verified, long
before its array or version is complete. The manifest's per-array checksum is the SHA-256
of the array's per-chunk CRC-32s (bridge/store/chunk_digest.py); manifests written since
`ArrayInfo.chunk_crcs` exists list those CRCs, and `chunk_plan` first checks that the list
hashes to the checksum, so a chunk is checked against the manifest, not against anything a
peer says. The manifest itself comes from the store (the root of trust) or is checked
against a SHA-256 the controller announced.

Stored bytes: zarr3 with the plain little-endian `bytes` codec (the store's default), so a
chunk's stored bytes are its C-order bytes; an edge chunk is stored padded to the full
chunk shape (its CRC covers the clipped prefix), and a chunk equal to the fill value (all
zeros) is not stored at all (a missing key must then CRC like zeros).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import zlib

from bridge.model import dtypes
from bridge.store import chunk_digest
from bridge.store.chunk_digest import chunk_boxes
from bridge.store.weight_store import Manifest


class MissingChunkDigests(ValueError):
    """The manifest predates per-chunk CRCs: the version can only be read from the store."""


@dataclasses.dataclass(frozen=True)
class ChunkSpec:
    key: str  # store key relative to the store root
    array: str
    crc: int
    nbytes: int  # clipped to the array: what the CRC covers
    full_nbytes: int  # a stored (padded) edge chunk is this long


def version_key(version: int) -> str:
    return f"{version:012d}"


def manifest_key(version: int) -> str:
    return f"manifests/{version_key(version)}.json"


def array_prefix(version: int, name: str) -> str:
    return f"data/{version_key(version)}/{name}/"


def key_version(key: str) -> int | None:
    """The version a store key belongs to (None for keys outside the layout)."""
    parts = key.split("/")
    if len(parts) == 2 and parts[0] == "manifests" and parts[1].endswith(".json"):
        stem = parts[1][:-5]
    elif len(parts) >= 3 and parts[0] == "data":
        stem = parts[1]
    else:
        return None
    return int(stem) if stem.isdigit() else None


def manifest_sha256(manifest_bytes: bytes) -> str:
    return hashlib.sha256(manifest_bytes).hexdigest()


def chunk_plan(version: int, manifest: Manifest) -> list[ChunkSpec]:
    """Every chunk of a version in manifest order, each with the CRC it must have."""
    out = []
    for name, info in manifest.arrays.items():
        if info.chunk_crcs is None:
            raise MissingChunkDigests(f"version {version}: array {name} has no chunk_crcs")
        combined = hashlib.sha256(b"".join(c.to_bytes(4, "big") for c in info.chunk_crcs))
        if combined.hexdigest() != info.checksum:
            raise ValueError(f"version {version}: array {name}: chunk_crcs do not match checksum")
        item = dtypes.itemsize(info.dtype)
        boxes = list(chunk_boxes(info.shape, info.chunks))
        if len(boxes) != len(info.chunk_crcs):
            raise ValueError(f"version {version}: array {name}: wrong number of chunk_crcs")
        full = math.prod(info.chunks) * item
        for (pos, box), crc in zip(boxes, info.chunk_crcs, strict=True):
            nbytes = math.prod(hi - lo for lo, hi in box) * item
            key = array_prefix(version, name) + "c/" + "/".join(map(str, pos))
            out.append(ChunkSpec(key, name, crc, nbytes, full))
    return out


def chunk_ok(spec: ChunkSpec, raw: bytes | None) -> bool:
    """Whether `raw` (None: the key is absent = all fill value) is this chunk's stored bytes."""
    if raw is None:
        return zlib.crc32(bytes(spec.nbytes)) == spec.crc
    if len(raw) not in (spec.nbytes, spec.full_nbytes):
        return False
    return zlib.crc32(memoryview(raw)[: spec.nbytes]) == spec.crc


def zarr_metadata(manifest: Manifest, name: str) -> dict:
    """The zarr3 metadata the store wrote for an array (WeightStore._create): a relay
    rebuilds it locally rather than trusting a peer's copy."""
    info = manifest.arrays[name]
    return chunk_digest.zarr3_metadata(info.shape, info.dtype, info.chunks)
