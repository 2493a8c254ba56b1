"""Which keys make up a published version, and how to verify one chunk of it on its own.

A relay moves a version key by key, in the weight store's own layout
(`bridge/store/layout.py`: manifests/{v}.json, data/{v}/{hf_name}/c/i/j), so a chunk can be
re-served the moment it is verified, long before its array or version is complete. The
manifest's per-array checksum is the SHA-256 of the array's per-chunk BLAKE3 digests
(bridge/store/chunk_digest.py); the manifest lists them (`ArrayInfo.chunk_digests`), and
`chunk_plan` first checks that the list hashes to the checksum, so a chunk is checked
against the manifest, not against anything a peer says; being cryptographic, a digest
cannot be matched by altered bytes (CRC-32s, used before, could). The manifest itself
comes from the store (the root of trust) or is checked against a SHA-256 the controller
announced.

Stored bytes: zarr3 with the plain little-endian `bytes` codec (the store's default), so a
chunk's stored bytes are its C-order bytes; an edge chunk is stored padded to the full
chunk shape (its digest covers the clipped prefix), and a chunk equal to the fill value
(all zeros) is not stored at all (a missing key must then digest like zeros).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

from bridge.model import dtypes
from bridge.store import chunk_digest
from bridge.store.chunk_digest import chunk_boxes
from bridge.store.layout import LAYOUT
from bridge.store.manifest import Manifest


class MissingChunkDigests(ValueError):
    """The manifest lists no per-chunk digests of this reader's algorithm (an older
    store's): the version can only be read from the store."""


@dataclasses.dataclass(frozen=True)
class ChunkSpec:
    key: str  # store key relative to the store root
    array: str
    digest: str  # chunk_digest.digest_bytes of the chunk's bytes, from the manifest
    nbytes: int  # clipped to the array: what the digest covers
    full_nbytes: int  # a stored (padded) edge chunk is this long


def manifest_sha256(manifest_bytes: bytes) -> str:
    return hashlib.sha256(manifest_bytes).hexdigest()


def chunk_plan(version: int, manifest: Manifest) -> list[ChunkSpec]:
    """Every chunk of a version in manifest order, each with the digest it must have."""
    if manifest.checksum_algorithm != chunk_digest.CHECKSUM_ALGORITHM:
        raise MissingChunkDigests(f"version {version}: {manifest.checksum_algorithm} checksums")
    if not manifest.is_full:
        # A delta version (bridge/delta/) stores patches, not every array's chunks: relays
        # move full versions (anchors) only, and a worker reads a delta from the store,
        # refused here before any chunk is asked for so no peer is blamed for a missing key.
        raise MissingChunkDigests(f"version {version} is a delta version: read from the store")
    out = []
    for name, info in manifest.arrays.items():
        digests = info.chunk_digests
        if digests is None:
            raise MissingChunkDigests(f"version {version}: array {name} has no chunk_digests")
        if chunk_digest.combine_ordered(digests) != info.checksum:
            raise ValueError(f"version {version}: array {name}: chunk digests != checksum")
        item = dtypes.itemsize(info.dtype)
        boxes = list(chunk_boxes(info.shape, info.chunks))
        if len(boxes) != len(digests):
            raise ValueError(f"version {version}: array {name}: wrong number of chunk digests")
        full = math.prod(info.chunks) * item
        for (pos, box), digest in zip(boxes, digests, strict=True):
            nbytes = math.prod(hi - lo for lo, hi in box) * item
            key = LAYOUT.chunk_key(version, name, pos)
            out.append(ChunkSpec(key, name, digest, nbytes, full))
    return out


def chunk_ok(spec: ChunkSpec, raw: bytes | None) -> bool:
    """Whether `raw` (None: the key is absent = all fill value) is this chunk's stored bytes."""
    if raw is None:
        return chunk_digest.digest_bytes(bytes(spec.nbytes)) == spec.digest
    if len(raw) not in (spec.nbytes, spec.full_nbytes):
        return False
    return chunk_digest.digest_bytes(memoryview(raw)[: spec.nbytes]) == spec.digest


def zarr_metadata(manifest: Manifest, name: str) -> dict:
    """The zarr3 metadata the store wrote for an array (WeightStore.create_array): a relay
    rebuilds it locally rather than trusting a peer's copy."""
    info = manifest.arrays[name]
    return chunk_digest.zarr3_metadata(info.shape, info.dtype, info.chunks)
