"""Publishing one weight version from several processes, each writing only its own shards.

A multi-host learner holds every tensor split over processes; no process may gather it. The
version is written in three phases, with a barrier between them (the caller's: the learner
uses JAX's coordination service, `learner_jax/publish.py`):

    leader:  begin(store, version, layout, dtype)   refuse an old/existing version, delete
                                                    debris of a crashed publish, create
                                                    every array (metadata only)
    barrier
    every:   write_part(store, version, process, sources, dtype)
                                                    write this process's pieces, digest each
                                                    chunk, record the digests in a part file
    barrier
    leader:  commit(store, version, ...)            read every part, check the parts cover
                                                    each array exactly once, write the
                                                    manifest (create-if-absent)

Readers see nothing until the manifest exists, exactly as for a single-process publish
(`WeightStore.publish`): the same array layout, chunk grid and checksums, so readers and
the relay cannot tell the two apart. Part files live in the version's data directory
(`LAYOUT.part_key`: `data/{version}/.parts/{process}.json`), so garbage collection and
crash-debris cleanup remove them with the data; they stay as the record of who wrote which
chunk.

A chunk must come from one piece (chunks align to shards, `chunk_digest.chunk_shape`): one
assembled from pieces of two processes cannot be digested by either, and is refused.

Versions written here are always full (anchors): a delta (bridge/weights/) diffs whole
tensors, which no process of a sharded learner holds; with `bridge.delta.enabled` a
multi-process learner still publishes full versions and its DeltaPublisher forgets its base.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

from bridge.model import dtypes
from bridge.store.chunk_digest import ChunkWriter, chunk_boxes, chunk_shape, combine_digests
from bridge.store.layout import LAYOUT
from bridge.store.manifest import ArrayInfo, Manifest, new_manifest
from bridge.store.weight_store import ShardedSource, WeightStore, stored_piece

# name -> (HF shape, shard block shape); every process computes the same from its sources.
Layout = Mapping[str, tuple[tuple[int, ...], tuple[int, ...] | None]]


def _chunks(shape, block, dtype: str) -> tuple[int, ...]:
    return chunk_shape(tuple(shape), dtypes.itemsize(dtype), block)


def begin(store: WeightStore, version: int, layout: Layout, dtype: str) -> None:
    """Leader, before anyone writes: check the version is new, clear debris, create arrays."""
    if not layout:
        raise ValueError("nothing to publish")
    store.begin_version(version, dtype)
    futures = []
    for name, (shape, block) in layout.items():
        if not name or "/" in name or not shape:
            raise ValueError(f"array {name!r} of shape {shape} cannot be published")
        chunks = _chunks(shape, block, dtype)
        futures.append(store.create_array(version, name, shape, dtype, chunks))
    for f in futures:
        f.result()


def write_part(
    store: WeightStore,
    version: int,
    process: int,
    sources: Iterable[tuple[str, ShardedSource]],
    dtype: str,
) -> dict[str, list[list[int]]]:
    """Write this process's pieces of every array; returns {name: chunk positions written}.

    `sources` yields every array (all processes list the same names), each with only the
    pieces this process writes (possibly none).
    """
    part: dict[str, dict[str, Any]] = {}
    pending = []
    for name, source in sources:
        chunks = _chunks(source.shape, source.block_shape, dtype)
        array = store.open_array(version, name, {"open": True}, write=True).result()
        writer = ChunkWriter(name, tuple(source.shape), chunks)
        for index, piece in source.pieces:
            for idx, data in writer.add(tuple(index), stored_piece(name, piece, dtype)):
                pending.append(array[idx].write(data))
        if writer.partial:
            raise ValueError(
                f"{name}: chunks {sorted(writer.partial)[:4]} span pieces of several "
                f"processes (chunk shape {chunks} does not align to the shards)"
            )
        part[name] = {
            "shape": list(source.shape),
            "chunks": list(chunks),
            "digests": [[*pos, digest] for pos, digest in sorted(writer.digests.items())],
        }
    for f in pending:
        f.result()
    # Written after its chunks: a part file says "these chunks are on storage".
    body = json.dumps({"process": process, "arrays": part}).encode()
    store.kv.write(LAYOUT.part_key(version, process), body).result()
    return {n: [c[:-1] for c in p["digests"]] for n, p in part.items()}


def read_parts(store: WeightStore, version: int, num_processes: int) -> list[dict]:
    """Every process's part file of `version` (raises naming the missing ones)."""
    parts, missing = [], []
    for p in range(num_processes):
        r = store.kv.read(LAYOUT.part_key(version, p)).result()
        if r.state != "value":
            missing.append(p)
        else:
            parts.append(json.loads(r.value))
    if missing:
        raise RuntimeError(f"version {version}: processes {missing} wrote no part file")
    return parts


def commit(
    store: WeightStore,
    version: int,
    step: int,
    num_processes: int,
    model_config: Mapping[str, Any],
    dtype: str,
    extra: Mapping[str, Any] | None = None,
) -> Manifest:
    """Leader, after every process wrote its part: check coverage, write the manifest."""
    parts = read_parts(store, version, num_processes)
    infos: dict[str, ArrayInfo] = {}
    for name in parts[0]["arrays"]:
        first = parts[0]["arrays"][name]
        shape, chunks = tuple(first["shape"]), tuple(first["chunks"])
        digests: dict[tuple[int, ...], str] = {}
        for part in parts:
            arr = part["arrays"].get(name)
            if arr is None or tuple(arr["shape"]) != shape or tuple(arr["chunks"]) != chunks:
                raise ValueError(f"{name}: process {part['process']} disagrees on its layout")
            for *pos, digest in arr["digests"]:
                if tuple(pos) in digests:
                    raise ValueError(f"{name}: chunk {pos} written by two processes")
                digests[tuple(pos)] = digest
        expected = {pos for pos, _ in chunk_boxes(shape, chunks)}
        if set(digests) != expected:
            raise ValueError(
                f"{name}: parts cover {len(digests)} of {len(expected)} chunks "
                f"(missing {sorted(expected - set(digests))[:4]})"
            )
        infos[name] = ArrayInfo(
            shape=shape,
            dtype=dtype,
            chunks=chunks,
            checksum=combine_digests(digests),
            chunk_digests=tuple(digests[p] for p in sorted(digests)),
            nbytes=math.prod(shape) * dtypes.itemsize(dtype),
        )
    names = [set(p["arrays"]) for p in parts]
    if any(n != names[0] for n in names):
        raise ValueError(f"version {version}: processes published different array sets")
    return store.write_manifest(new_manifest(version, step, dtype, model_config, infos, extra))
