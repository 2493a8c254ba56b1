"""A relay's verified copy of the versions it holds (the cache `peer_fetch.fetch_version`
fills), and the catch-up of a worker along a delta chain.

The cache is a WeightStore (a `memory` kvstore by default) in the store's own layout. A
version is begun once its manifest is known (zarr metadata rebuilt locally for the arrays
whose chunks it will hold), each key is put once verified, and the manifest is written
last, so the worker reads a complete version through the unchanged verified path
(`weight_swap.load_version`). The newest `keep_versions` complete versions are kept, and
every version of the last two catch-up paths (`pin`), which the worker may still be
rebuilding from.

Catch-up (`fetch_chain`): a worker serving version `have` that is told of `target` needs
what `bridge/weights/delta_reconstruct.py` will read: the deltas after `have`, or the nearest anchor
whole and the deltas after it, whichever is fewer bytes (`choose_path`, on the manifests
read from the last source, the root of trust). The relay fetches exactly those versions,
oldest first, each key through the parent and fallbacks like any chunk and verified on
arrival (a patch against its BLAKE3 digest in the manifest, a dense tensor's chunks
against the full tensor's chunk digests); the worker then rebuilds from this cache with
the same `have`, so it takes the same path, and verifies every rebuilt tensor again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import tensorstore as ts

from bridge.broadcast import chunks as chunks_lib
from bridge.store.layout import LAYOUT
from bridge.store.manifest import Manifest, VersionNotFoundError
from bridge.weights import delta_reconstruct as reconstruct
from bridge.weights import kinds
from rollout_gpu import peer_fetch


@dataclasses.dataclass
class CachedVersion:
    manifest_bytes: bytes
    plan: dict[str, chunks_lib.ChunkSpec]
    # The plan covers every key stored under the version (a full version held whole, or a
    # delta version's hop); False: an anchor held only as its patch (other keys: 410).
    every_key: bool = True
    have: set = dataclasses.field(default_factory=set)
    absent: set = dataclasses.field(default_factory=set)
    complete: bool = False
    failed: str = ""
    started_at: float = dataclasses.field(default_factory=time.time)
    completed_at: float = 0.0


class VersionCache:
    """The `begin` / `put` / `finish` interface of peer_fetch.fetch_version on `self.mirror`
    (a Relay's; it also provides `versions`, `keep_versions` and `_notify`)."""

    _pins: tuple[frozenset, frozenset] = (frozenset(), frozenset())

    async def begin(self, version, manifest_bytes, manifest: Manifest, plan) -> None:
        held = chunks_lib.held_arrays(plan)
        await asyncio.gather(
            *(
                self.mirror.open_array(
                    version,
                    name,
                    {
                        "metadata": chunks_lib.zarr_metadata(manifest, name),
                        "create": True,
                        "delete_existing": True,
                    },
                )
                for name in manifest.arrays
                if name in held
            )
        )
        every_key = kinds.strategy_of(manifest).complete_copy(manifest, held)
        self.versions[version] = CachedVersion(manifest_bytes, {s.key: s for s in plan}, every_key)
        self._notify()

    async def put(self, version: int, key: str, raw: bytes | None) -> None:
        st = self.versions[version]
        if raw is None:
            st.absent.add(key)
        else:
            await self.mirror.kv.write(key, raw)
            st.have.add(key)
        self._notify()

    async def finish(self, version: int) -> None:
        st = self.versions[version]
        await self.mirror.kv.write(LAYOUT.manifest_key(version), st.manifest_bytes)
        st.complete, st.completed_at = True, time.time()
        self._notify()
        complete = sorted(v for v, s in self.versions.items() if s.complete)
        pinned = self._pins[0] | self._pins[1]
        for v in complete[: -self.keep_versions]:  # keep the newest S+1 (or more)
            if v not in pinned:
                await self._drop(v)

    async def _drop(self, version: int) -> None:
        self.versions.pop(version, None)
        self.results.pop(version, None)
        kv = self.mirror.kv
        await kv.delete_range(ts.KvStore.KeyRange(*LAYOUT.data_range(version, version + 1)))
        await kv.write(LAYOUT.manifest_key(version), None)

    def holds(self, version: int, whole: bool | None) -> bool:
        """`version` is complete here with the keys a `whole` (or hop) reader needs."""
        st = self.versions.get(version)
        return st is not None and st.complete and not st.failed and (not whole or st.every_key)

    async def fetch_chain(self, target, sources, have, manifest_sha256=None):
        """Fetch what a worker serving `have` (None: no copy) needs to rebuild `target`; one
        FetchResult summed over the versions fetched."""
        t0 = time.monotonic()
        root = peer_fetch.Reader(peer_fetch.Source.parse(sources[-1]), self.session, self.stall_s)
        loop, wait_s = asyncio.get_running_loop(), max(60.0, 2 * self.stall_s)

        class Manifests:  # reconstruct.links reads manifests synchronously (in a thread)
            def manifest(self, version: int) -> Manifest:
                key = LAYOUT.manifest_key(version)
                read = asyncio.run_coroutine_threadsafe(root.read(key), loop)
                raw = read.result(timeout=wait_s)  # bounded: the loop may be stopping
                if raw is None:
                    raise VersionNotFoundError(f"version {version}: no manifest")
                return Manifest.model_validate_json(raw)

        chain = await asyncio.to_thread(reconstruct.links, Manifests(), target, have)
        from_full, path = reconstruct.choose_path(chain, have)
        self._pins = (self._pins[1], frozenset(m.version for m in path))
        total = peer_fetch.FetchResult(target)
        for i, m in enumerate(path):
            sha = manifest_sha256 if m.version == target else None
            whole = from_full and i == 0
            fresh = not self.holds(m.version, whole)  # else counted when it was fetched
            got = await self._fetch(m.version, sources, sha, whole=whole)
            if not fresh:
                continue
            total.bytes_total += got.bytes_total
            total.bytes_from_store += got.bytes_from_store
            for source, n in got.bytes_by_source.items():
                total.bytes_by_source[source] = total.bytes_by_source.get(source, 0) + n
            total.reports += got.reports
        if total.bytes_total or total.reports:  # else: held already, nothing new to report
            total.finished_at = time.monotonic()
            total.seconds = total.finished_at - t0
        return total
