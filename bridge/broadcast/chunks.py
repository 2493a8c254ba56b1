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

Delta versions (bridge/weights/) travel the same way: a hop's plan is the version's patch
objects (`LAYOUT.patch_key`, each checked against the BLAKE3 digest its manifest entry
`TensorPatch.digest` lists; a patch larger than a chunk as its chunk-sized pieces,
`LAYOUT.patch_piece_key`, each against its digest in `TensorPatch.pieces`, so it pipelines
over the chain like a tensor's chunks) and the chunks of its dense tensors (the FULL tensor's chunk
digests, as for any array). An anchor is planned whole (every chunk) for a reader with
no copy, plus its patches, so a relay holding it whole serves both kinds of reader.

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
from bridge.weights import kinds


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
    patch: bool = False  # a delta version's patch object: never absent, never padded


def manifest_sha256(manifest_bytes: bytes) -> str:
    return hashlib.sha256(manifest_bytes).hexdigest()


def chunk_plan(version: int, manifest: Manifest, whole: bool | None = None) -> list[ChunkSpec]:
    """The keys of a version in manifest order, each with the digest it must have.

    `whole`: every chunk of every array (default for a full version), plus the patches of an
    anchor that carries them; False: what a reader one version behind needs (a delta hop:
    patches and dense tensors; refused for a full version without a patch)."""
    if manifest.checksum_algorithm != chunk_digest.CHECKSUM_ALGORITHM:
        raise MissingChunkDigests(f"version {version}: {manifest.checksum_algorithm} checksums")
    out = []
    # The version's kind says what it is made of: (tensor, patch object or None, chunks too).
    for name, patch, chunks in kinds.strategy_of(manifest).parts(manifest, whole):
        if patch is not None:
            objects = patch.objects(version, name)  # one object, or its chunk-sized pieces
            if not patch.digest or not all(digest for _, digest, _ in objects):
                raise MissingChunkDigests(f"version {version}: patch of {name} has no digest")
            out.extend(ChunkSpec(k, name, d, n, n, True) for k, d, n in objects)
        if chunks:
            out.extend(_array_chunks(version, name, manifest.arrays[name]))
    return out


def _array_chunks(version: int, name: str, info) -> list[ChunkSpec]:
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
    out = []
    for (pos, box), digest in zip(boxes, digests, strict=True):
        nbytes = math.prod(hi - lo for lo, hi in box) * item
        out.append(ChunkSpec(LAYOUT.chunk_key(version, name, pos), name, digest, nbytes, full))
    return out


def held_arrays(plan: list[ChunkSpec]) -> set[str]:
    """The arrays a plan stores chunks of (a relay creates their zarr metadata)."""
    return {s.array for s in plan if not s.patch}


def chunk_ok(spec: ChunkSpec, raw: bytes | None) -> bool:
    """Whether `raw` (None: the key is absent = all fill value) is this chunk's stored bytes."""
    if raw is None and spec.patch:
        return False
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
