"""Versioned, immutable weight store on a tensorstore kvstore (numpy + tensorstore + pydantic).

The learner publishes one version per `publish_every` steps; rollout workers list, fetch and
verify versions. One code path serves the `file`, `memory`, `s3` and `gcs` kvstores. Where
each key lives (manifests/{version}.json written last, create-if-absent; data/{version}/
{hf_name}/ one zarr3 array per HF tensor) is `bridge/store/layout.py: LAYOUT`.

A sharded jax.Array arrives as a `ShardedSource` of its addressable shards in HF layout
(`learner_jax/publish.py`). Chunks are aligned to the shard shape, so the writer digests
each shard as it passes, never gathering a tensor, and on a multi-host learner no chunk
would be written by two hosts (`sharded_publish.py` uses the public steps below:
`begin_version`, `create_array`, `open_array`, `stored_piece`, `write_manifest`).
Checksums (`bridge/store/chunk_digest.py`): per-chunk BLAKE3 digests of the stored bytes
combined by SHA-256 in chunk order; readers recompute them from what they read and raise
`CorruptVersionError` naming the array on any mismatch (or on a manifest checksummed by
another algorithm). The manifest also lists each array's chunk digests (`chunk_digests`),
so a peer relay can verify every chunk on its own as it arrives (bridge/broadcast/chunks.py).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import urlparse

import numpy as np
import pydantic
import tensorstore as ts

from bridge.model import dtypes
from bridge.store.chunk_digest import (
    CHECKSUM_ALGORITHM,
    ChunkWriter,
    array_checksum,
    chunk_shape,
    zarr3_metadata,
)
from bridge.store.layout import LAYOUT
from bridge.store.manifest import (
    ArrayInfo,
    CorruptVersionError,
    Manifest,
    VersionExistsError,
    VersionNotFoundError,
    new_manifest,
)

INFLIGHT_BYTES = 512 << 20  # bound on written-but-uncommitted bytes held alive
DRIVERS = ("file", "memory", "s3", "gcs")
# One Context per process: `memory` kvstores are scoped to a Context, so every WeightStore
# in this process on "memory://name" sees the same data.
_CONTEXT = ts.Context()
_FLOAT_DTYPES = [np.dtype(t) for t in (*dtypes.WEIGHT_DTYPES.values(), np.float64)]
_ABSENT = b"\x02"  # tensorstore's "no value" generation: makes a write create-if-absent


@dataclasses.dataclass(frozen=True)
class ShardedSource:
    """A tensor given as pieces `(index, block)` in HF layout that cover it exactly once.

    `index` is a tuple of step-1 slices into `shape`. `block_shape` (the shard shape) makes
    chunks align to shards, so each chunk's digest comes from one piece.
    """

    shape: tuple[int, ...]
    pieces: Iterable[tuple[tuple[slice, ...], np.ndarray]]
    block_shape: tuple[int, ...] | None = None


def parse_spec(spec: str | Mapping[str, Any]) -> dict[str, Any]:
    """A kvstore JSON spec (path ending in "/") from a URL, a local path or a spec dict."""
    if isinstance(spec, str) and spec.startswith("memory://"):
        # Any name will do (no urlparse: it reads "[...]" as an IPv6 host).
        out = {"driver": "memory", "path": spec[len("memory://") :].strip("/")}
    elif isinstance(spec, str):
        url = urlparse(spec)
        if url.scheme in ("", "file"):
            path = url.path if url.scheme else spec
            if url.scheme == "file" and url.netloc not in ("", "localhost"):
                raise ValueError(f"file URL must be file:///abs/path, got {spec!r}")
            out = {"driver": "file", "path": os.path.abspath(path)}
        elif url.scheme in ("s3", "gs"):
            if not url.netloc:
                raise ValueError(f"{spec!r} names no bucket")
            driver = "s3" if url.scheme == "s3" else "gcs"
            out = {"driver": driver, "bucket": url.netloc, "path": url.path.strip("/")}
        else:
            raise ValueError(
                f"unsupported store URL {spec!r}; use file://, memory://, s3://, gs://"
            )
    else:
        out = dict(spec)
    if out.get("driver") not in DRIVERS:
        raise ValueError(f"unsupported kvstore driver {out.get('driver')!r}; use one of {DRIVERS}")
    if out["driver"] in ("s3", "gcs") and not out.get("bucket"):
        raise ValueError(f"{out['driver']} spec needs a bucket: {out}")
    path = out.get("path", "")
    out["path"] = path if not path or path.endswith("/") else path + "/"
    ts.KvStore.Spec(out)  # validates field names and types; opens nothing
    return out


def stored_piece(name: str, piece, dtype: str) -> np.ndarray:
    """A piece of tensor `name` as the store holds it (refuses non-float weights)."""
    piece = np.asarray(piece)
    if piece.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name}: dtype {piece.dtype} is not a float weight")
    return piece.astype(dtypes.WEIGHT_DTYPES[dtype], copy=False)


def _ahead(items: Iterable, start, depth: int, pending=None) -> Iterator[tuple[Any, Any]]:
    """Yield (item, start(item)), keeping `depth` items started ahead of the consumer."""
    pending = collections.deque() if pending is None else pending
    for item in items:
        pending.append((item, start(item)))
        if len(pending) > depth:
            yield pending.popleft()
    while pending:
        yield pending.popleft()


class WeightStore:
    """Publish, list, read and garbage-collect immutable weight versions."""

    def __init__(self, spec: str | Mapping[str, Any]):
        self.spec = parse_spec(spec)
        self._kv: ts.KvStore | None = None  # opened on first use: building a spec is offline

    def __repr__(self):
        return f"WeightStore({self.spec})"

    @property
    def kv(self) -> ts.KvStore:
        if self._kv is None:
            self._kv = ts.KvStore.open(self.spec, context=_CONTEXT).result()
        return self._kv

    def array_spec(self, version: int, name: str) -> dict[str, Any]:
        """The zarr3 tensorstore spec of one array of a version."""
        kv = {**self.spec, "path": self.spec["path"] + LAYOUT.array_prefix(version, name)}
        return {"driver": "zarr3", "kvstore": kv}

    def open_array(self, version: int, name: str, spec: Mapping[str, Any], **kwargs):
        """A future of the opened array (`spec` adds open/create/metadata options)."""
        return ts.open({**self.array_spec(version, name), **spec}, context=_CONTEXT, **kwargs)

    def create_array(self, version: int, name: str, shape, dtype: str, chunks):
        """A future of a newly created, empty array in the store's codec and chunk grid."""
        metadata = zarr3_metadata(shape, dtype, chunks)
        return self.open_array(version, name, {"metadata": metadata, "create": True})

    # -- listing ------------------------------------------------------------------------
    def versions(self) -> list[int]:
        """Published versions (those whose manifest exists), ascending."""
        rng = ts.KvStore.KeyRange(*LAYOUT.manifest_range())
        keys = self.kv.list(rng, strip_prefix_length=len(LAYOUT.manifests)).result()
        listed = (LAYOUT.listed_version(key.decode()) for key in keys)
        return sorted(v for v in listed if v is not None)

    def latest(self) -> int | None:
        v = self.versions()
        return v[-1] if v else None

    def manifest(self, version: int) -> Manifest:
        r = self.kv.read(LAYOUT.manifest_key(version)).result()
        if r.state != "value":
            raise VersionNotFoundError(
                f"version {version} has no manifest in {self.spec} (not published, still "
                f"being written, or garbage-collected); published: {self.versions()}"
            )
        try:
            return Manifest.model_validate_json(r.value)
        except pydantic.ValidationError as e:
            raise CorruptVersionError(f"version {version}: unreadable manifest: {e}") from e

    # -- publish ------------------------------------------------------------------------
    def publish(
        self,
        version: int,
        step: int,
        arrays: Iterable[tuple[str, np.ndarray | ShardedSource]],
        model_config: Mapping[str, Any],
        dtype: str = "bfloat16",
        extra: Mapping[str, Any] | None = None,
    ) -> Manifest:
        """Write every array (concurrently), then the manifest. Returns the manifest."""
        self.begin_version(version, dtype)
        infos: dict[str, ArrayInfo] = {}
        inflight: collections.deque = collections.deque()
        inflight_bytes, published_elsewhere = 0, False
        names, opening = set(), collections.deque()
        try:
            # Array creations run ahead of the data writes: on S3/GCS each is round trips.
            create = lambda item: self._create(version, dtype, names, item)
            for (name, _), (source, chunks, open_future) in _ahead(arrays, create, 32, opening):
                store = open_future.result()
                writer = ChunkWriter(name, store.shape, chunks)
                for index, piece in source.pieces:
                    piece = stored_piece(name, piece, dtype)
                    for idx, data in writer.add(tuple(index), piece):
                        inflight.append((store[idx].write(data), data.nbytes))
                        inflight_bytes += data.nbytes
                        while inflight_bytes > INFLIGHT_BYTES:
                            fut, nbytes = inflight.popleft()
                            fut.result()
                            inflight_bytes -= nbytes
                infos[name] = ArrayInfo(
                    shape=writer.shape,
                    dtype=dtype,
                    chunks=chunks,
                    checksum=writer.checksum(),
                    chunk_digests=tuple(writer.digests[p] for p in sorted(writer.digests)),
                    nbytes=math.prod(writer.shape) * dtypes.itemsize(dtype),
                )
            while inflight:
                inflight.popleft()[0].result()
            if not infos:
                raise ValueError("nothing to publish")
            manifest = new_manifest(version, step, dtype, model_config, infos, extra)
            try:
                return self.write_manifest(manifest)
            except VersionExistsError:
                published_elsewhere = True  # its data is not ours to delete
                raise
        except BaseException:
            # Let pending writes land, so none recreates a key after the cleanup.
            for fut in [f for f, _ in inflight] + [item[1][2] for item in opening]:
                try:
                    fut.result()
                except Exception:
                    pass
            if not published_elsewhere:
                self._delete_data(version, version + 1)
            raise

    def begin_version(self, version: int, dtype: str) -> None:
        """Before writing a version: check it is new and clear debris of a crashed publish."""
        if dtype not in dtypes.WEIGHT_DTYPES:
            raise ValueError(f"store dtype {dtype!r} not in {sorted(dtypes.WEIGHT_DTYPES)}")
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        self._check_new(version)
        self._delete_data(version, version + 1)

    def write_manifest(self, manifest: Manifest) -> Manifest:
        """Publish a version whose arrays are all written: its manifest, create-if-absent."""
        self._check_new(manifest.version)  # a newer version may have appeared meanwhile
        key = LAYOUT.manifest_key(manifest.version)
        if not self.kv.write(key, manifest.to_json(), if_equal=_ABSENT).result().generation:
            raise VersionExistsError(f"version {manifest.version} was published concurrently")
        return manifest

    def _create(self, version: int, dtype: str, names: set, item):
        """Starts creating the zarr3 array of one tensor; returns (source, chunks, future)."""
        if not isinstance(item, tuple) or len(item) != 2:
            raise ValueError(f"arrays must yield (hf_name, array) pairs, got {type(item).__name__}")
        name, source = item
        if not isinstance(name, str) or not name or "/" in name or name in names:
            raise ValueError(f"array name {name!r} is empty, has '/' or repeats")
        names.add(name)
        if isinstance(source, ShardedSource):
            shape, block = tuple(source.shape), source.block_shape
        else:
            array = np.asarray(source)
            shape, block = array.shape, None
            source = ShardedSource(shape, [((slice(None),) * array.ndim, array)])
        if not shape:
            raise ValueError(f"{name}: scalars are not weights")
        chunks = chunk_shape(shape, dtypes.itemsize(dtype), block)
        return source, chunks, self.create_array(version, name, shape, dtype, chunks)

    def _check_new(self, version: int) -> None:
        existing = self.versions()
        if version in existing:
            raise VersionExistsError(f"version {version} is already published (immutable)")
        if existing and version <= existing[-1]:
            raise ValueError(f"version {version} is not newer than the latest {existing[-1]}")

    # -- read ---------------------------------------------------------------------------
    def read(
        self, version: int, names: Iterable[str] | None = None, depth: int = 8
    ) -> Iterator[tuple[str, np.ndarray]]:
        """Yield (name, array) in manifest order, each verified against the manifest; a delta
        version is rebuilt from its anchor first (bridge/weights/delta_reconstruct.py)."""
        from bridge.weights.delta_reconstruct import read_version

        yield from read_version(self, version, names, depth)

    def read_stored(
        self, version: int, names: Iterable[str] | None = None, depth: int = 8
    ) -> Iterator[tuple[str, np.ndarray]]:
        """Yield (name, array) of the arrays stored under `version`, each verified.

        Opens run 32 arrays ahead and reads `depth` arrays ahead, so I/O overlaps with
        checksumming.
        """
        manifest = self.manifest(version)
        if manifest.checksum_algorithm != CHECKSUM_ALGORITHM:  # e.g. CRC-32s of old stores
            raise CorruptVersionError(
                f"version {version}: checksums are {manifest.checksum_algorithm!r}, this "
                f"reader verifies {CHECKSUM_ALGORITHM!r} only (republish the version)"
            )
        names = list(manifest.arrays if names is None else names)
        unknown = [n for n in names if n not in manifest.arrays]
        if unknown:
            raise KeyError(f"version {version} has no arrays {unknown[:5]}")
        opened = _ahead(names, lambda n: self.open_array(version, n, {"open": True}, read=True), 32)
        reads = _ahead(opened, lambda item: self._read_checked(version, manifest, *item), depth)
        for (name, _), future in reads:
            try:
                data = future.result()
            except Exception as e:  # decode errors of torn/truncated chunks
                raise CorruptVersionError(f"version {version}: array {name}: {e}") from e
            yield name, _verify(version, name, manifest.arrays[name], data)

    def _read_checked(self, version: int, manifest: Manifest, name: str, open_future):
        info = manifest.arrays[name]
        try:
            store = open_future.result()
        except Exception as e:
            raise CorruptVersionError(f"version {version}: array {name} unreadable: {e}") from e
        if tuple(store.shape) != info.shape:
            raise CorruptVersionError(
                f"version {version}: array {name} has shape {tuple(store.shape)}, "
                f"manifest says {info.shape}"
            )
        if store.dtype.name != info.dtype:
            raise CorruptVersionError(
                f"version {version}: array {name} has dtype {store.dtype.name}, "
                f"manifest says {info.dtype}"
            )
        return store.read()

    def read_all(self, version: int, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
        """Every array of a version, all verified before any is returned."""
        return dict(self.read(version, names))

    # -- garbage collection ------------------------------------------------------------
    def gc(self, keep: int) -> list[int]:
        """Delete all but the newest `keep` versions and the chain they are rebuilt from;
        returns the deleted versions."""
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"gc keeps at least 1 version, got keep={keep!r}")
        existing = self.versions()
        # A kept delta version needs its chain back to its anchor (bridge/weights/): keep it.
        floor = self.manifest(existing[-keep]).anchor if len(existing) > keep else 0
        doomed = [v for v in existing[:-keep] if v < floor]
        for v in doomed:  # manifest first: a half-deleted version is never visible
            self.kv.write(LAYOUT.manifest_key(v), None).result()
        if doomed:
            # Also removes debris of crashed publishes older than the oldest kept version.
            self._delete_data(0, floor)
        return doomed

    def drop_newer(self, version: int) -> list[int]:
        """Delete every version newer than `version` (a crashed run's versions past its last
        checkpoint, which the rerun republishes with other weights); returns them."""
        doomed = [v for v in self.versions() if v > version]
        for v in doomed:  # manifest first: a half-deleted version is never visible
            self.kv.write(LAYOUT.manifest_key(v), None).result()
        if doomed:
            self._delete_data(version + 1, LAYOUT.max_version)
        return doomed

    def _delete_data(self, lo: int, hi: int) -> None:
        """Delete the arrays of versions lo <= v < hi (their manifests must be gone first)."""
        self.kv.delete_range(ts.KvStore.KeyRange(*LAYOUT.data_range(lo, hi))).result()


def _verify(version: int, name: str, info: ArrayInfo, data: np.ndarray) -> np.ndarray:
    if data.shape != info.shape or data.dtype.name != info.dtype:
        raise CorruptVersionError(
            f"version {version}: array {name} is {data.dtype.name}{list(data.shape)}, "
            f"manifest says {info.dtype}{list(info.shape)}"
        )
    got = array_checksum(data, info.chunks)
    if got != info.checksum:
        raise CorruptVersionError(
            f"version {version}: array {name} checksum mismatch (corrupt, truncated or "
            f"stale chunk): got {got[:16]}, manifest {info.checksum[:16]}"
        )
    return data
