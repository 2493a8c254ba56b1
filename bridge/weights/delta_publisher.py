"""Publishing versions as deltas on the previous one, with a full anchor now and then.

    pub = DeltaPublisher(store, anchor_every=10, max_density=0.5)
    manifest = pub.publish(version, step, arrays, model_config, "bfloat16", extra)
    pub.last                     # PublishStats: bytes stored, density, anchor or delta

The publisher keeps the last version it published in the stored dtype (one model of host
RAM). Each new version is compared with it element by element on the stored bytes; what
changed is written as a patch per tensor (bridge/weights/delta_codec.py), a tensor denser than
`max_density` as an ordinary array, an unchanged tensor not at all. The manifest names the
base and the anchor and keeps the FULL tensors' checksums and chunk digests (the same
chunk grid a full publish of a whole array uses), so a reader verifies what it rebuilt.

Every tensor is also stored whole (the version is an anchor) when: `anchor_every` versions
have been published since the last anchor, the store's newest version is not the one this
publisher remembers (another writer, a rollback), or the caller asks (`anchor=True`). An
anchor still carries its patch on the previous version, so a reader one version behind
crosses it by the patch; only a reader with no copy (a late joiner) downloads it whole.
With nothing to diff against (a fresh learner, or one resumed from a checkpoint: this
publisher has published nothing yet) the version is a plain full one, without a patch. A
multi-process learner publishes full versions only (sharded_publish.py: no process holds a
whole tensor to diff); `forget()` after such a publish so the next one here is full too.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from bridge.model import dtypes
from bridge.store import chunk_digest
from bridge.store.chunk_digest import ChunkWriter, chunk_shape, digest_bytes
from bridge.store.manifest import ArrayInfo, DeltaInfo, Manifest, TensorPatch, new_manifest
from bridge.store.weight_store import INFLIGHT_BYTES, ShardedSource, WeightStore, stored_piece
from bridge.weights import delta_codec as codec


@dataclasses.dataclass(frozen=True)
class PublishStats:
    version: int
    anchor: bool
    stored_bytes: int  # what the version added to the store
    full_bytes: int  # what a full copy is
    density: float  # fraction of elements whose stored bytes changed vs the previous version
    uncompressed_bytes: int = 0  # the hop's patches (+ dense tensors) without zstd


def whole(name: str, source, dtype: str) -> np.ndarray:
    """A tensor in the stored dtype, assembled from a ShardedSource's pieces (or an array)."""
    if not isinstance(source, ShardedSource):
        return np.ascontiguousarray(stored_piece(name, source, dtype))
    out = np.empty(source.shape, dtypes.WEIGHT_DTYPES[dtype])
    covered = 0
    for index, piece in source.pieces:
        block = np.ascontiguousarray(stored_piece(name, piece, dtype))
        uint = np.dtype(f"<u{out.itemsize}")  # copied as uints: bf16 copies are ~10x slower
        out.view(uint)[tuple(index)] = block.view(uint)
        covered += block.size
    if covered != out.size:
        raise ValueError(f"{name}: pieces cover {covered} of {out.size} elements")
    return out


def array_info(name: str, array: np.ndarray, dtype: str) -> ArrayInfo:
    """The manifest entry of a whole tensor on the chunk grid a full publish would use."""
    chunks = chunk_shape(array.shape, dtypes.itemsize(dtype), None)
    writer = ChunkWriter(name, array.shape, chunks)
    writer.add(tuple(slice(None, n) for n in array.shape), array)
    return ArrayInfo(
        shape=array.shape,
        dtype=dtype,
        chunks=chunks,
        checksum=writer.checksum(),
        chunk_digests=tuple(writer.digests[p] for p in sorted(writer.digests)),
        nbytes=array.nbytes,
    )


class DeltaPublisher:
    def __init__(self, store: WeightStore, anchor_every: int, max_density: float):
        if anchor_every < 1 or not 0.0 <= max_density <= 1.0:
            raise ValueError(
                f"bridge.delta.anchor_every must be >= 1 and max_density in [0, 1], got "
                f"{anchor_every}, {max_density}"
            )
        self.store, self.anchor_every, self.max_density = store, anchor_every, max_density
        self.last: PublishStats | None = None
        self._prev: dict[str, np.ndarray] | None = None  # the last published version's tensors
        self._prev_version: int | None = None
        self._anchor: int | None = None
        self._since_anchor = 0
        self._raw_bytes = 0

    def forget(self) -> None:
        """Drop the remembered version (someone else published): the next one is an anchor."""
        self._prev = self._prev_version = self._anchor = None

    def publish(
        self,
        version: int,
        step: int,
        arrays: Iterable[tuple[str, np.ndarray | ShardedSource]],
        model_config: Mapping[str, Any],
        dtype: str = "bfloat16",
        extra: Mapping[str, Any] | None = None,
        anchor: bool = False,
    ) -> Manifest:
        tensors = {name: whole(name, source, dtype) for name, source in arrays}
        prev, prev_version, prev_anchor = self._prev, self._prev_version, self._anchor
        self._raw_bytes = 0
        self.forget()  # until this publish succeeds, nothing is remembered
        diffable = prev is not None and _same_layout(prev, tensors)
        full = (
            not diffable
            or anchor
            or self._since_anchor >= self.anchor_every - 1
            or self.store.latest() != prev_version
        )
        if not diffable:  # nothing to patch from: a plain full version
            manifest = self.store.publish(
                version, step, tensors.items(), model_config, dtype, extra
            )
            density = 1.0
        else:
            base = (prev_version, version if full else prev_anchor)
            manifest = self._write(version, step, base, prev, tensors, model_config, dtype, extra)
            density = manifest.delta.density
        self._since_anchor = 0 if full else self._since_anchor + 1
        self._prev, self._prev_version, self._anchor = tensors, version, manifest.anchor
        self.last = PublishStats(
            version,
            manifest.is_full,
            manifest.stored_bytes,
            manifest.total_bytes,
            density,
            self._raw_bytes,
        )
        return manifest

    def _write(self, version, step, base, prev, tensors, model_config, dtype, extra):
        """Write `tensors` as patches on `prev` (`base` = (its version, the anchor)); when
        the anchor is this version, every tensor is also stored whole. Returns the manifest."""
        store, full = self.store, base[1] == version
        store.begin_version(version, dtype)
        pending: collections.deque = collections.deque()
        inflight = 0
        try:
            infos, patches = {}, {}
            self._raw_bytes = 0
            for name, new in tensors.items():
                infos[name] = array_info(name, new, dtype)
                enc = codec.encode(prev[name], new, self.max_density)
                writes = []
                self._raw_bytes += new.nbytes if enc.kind == "dense" else enc.raw_nbytes
                if enc.kind == "patch":
                    patches[name] = patch_entry(enc)
                    pieces = _pieces(enc.blob, patches[name].piece_nbytes)
                    for (key, _, _), piece in zip(
                        patches[name].objects(version, name), pieces, strict=True
                    ):
                        writes.append(store.kv.write(key, bytes(piece)))
                else:
                    nbytes = new.nbytes if enc.kind == "dense" else 0
                    patches[name] = TensorPatch(kind=enc.kind, changed=enc.changed, nbytes=nbytes)
                if full or enc.kind == "dense":
                    array = store.create_array(version, name, new.shape, dtype, infos[name].chunks)
                    writes.append(array.result().write(new))
                for fut in writes:
                    pending.append((fut, new.nbytes))
                    inflight += new.nbytes
                while inflight > INFLIGHT_BYTES:  # bound what is held alive in flight
                    fut, nbytes = pending.popleft()
                    fut.result()
                    inflight -= nbytes
            for fut, _ in pending:
                fut.result()
            changed = sum(p.changed for p in patches.values())
            delta = DeltaInfo(
                base=base[0],
                anchor=base[1],
                nbytes=sum(p.nbytes for p in patches.values()),
                density=changed / max(1, sum(t.size for t in tensors.values())),
                tensors=patches,
            )
            manifest = new_manifest(version, step, dtype, model_config, infos, extra, delta)
            return store.write_manifest(manifest)
        except BaseException:
            for fut, _ in pending:
                try:
                    fut.result()
                except Exception:
                    pass
            store._delete_data(version, version + 1)
            raise


# Patch piece size; None = the store's chunk size (bench.broadcast sets it to compare a
# patch moved as one object per hop).
PIECE_BYTES: int | None = None


def patch_entry(enc: codec.Encoded) -> TensorPatch:
    """The manifest entry of a patch: one object up to the store's chunk size, else pieces
    of that size, each with its digest (a relay pipelines them like chunks)."""
    blob = enc.blob
    piece = PIECE_BYTES or chunk_digest.CHUNK_BYTES  # read now: tests shrink the chunks
    entry = {"kind": "patch", "changed": enc.changed, "nbytes": len(blob)}
    if len(blob) > piece:
        pieces = tuple(digest_bytes(p) for p in _pieces(blob, piece))
        entry.update(pieces=pieces, piece_nbytes=piece)
    return TensorPatch(**entry, digest=digest_bytes(blob))


def _pieces(blob: bytes, size: int) -> list[memoryview]:
    view = memoryview(blob)
    return [view] if not size else [view[i : i + size] for i in range(0, len(blob), size)]


def _same_layout(prev: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray]) -> bool:
    return list(prev) == list(new) and all(
        prev[n].shape == new[n].shape and prev[n].dtype == new[n].dtype for n in new
    )
