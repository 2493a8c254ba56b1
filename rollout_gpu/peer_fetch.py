"""Fetch one weight version chunk by chunk from a parent relay, its fallbacks, then the store.

Sources are tried in order for each chunk: the parent relay, the fallback relays the
controller named (grandparent first), and last the weight store itself (the root of
trust; today's only source). Every chunk is checked against the manifest's per-chunk
BLAKE3 digests (bridge/broadcast/chunks.py) the moment it arrives; only verified chunks enter the
local cache, so only verified chunks are ever relayed onward.

  * a chunk that fails its check is fetched again from the next source and the source is
    reported ("corrupt"); after BAD_LIMIT bad chunks it is dropped for this version;
  * a relay that answers 410 does not hold that key and will not (a version it skipped or
    dropped, or an anchor it holds only as a patch): the next source serves it, and the
    relay is not blamed;
  * a source that refuses connections, errors, or makes no progress for `stall_s` (a relay
    says how many chunks it holds in every "not yet" answer, so a parent that is itself
    waiting on a slow grandparent is not taken for dead) is reported ("dead") and skipped
    for the rest of the version;
  * with `min_rate` (bytes/s; `worker.peer_min_bytes_per_s`) a relay that sends a chunk's
    body slower than that on average, after MIN_RATE_GRACE_S, is dead too ("too slow"):
    a parent that trickles bytes never stalls for `stall_s` and would otherwise hold its
    children at its pace for the whole version. Off (0) by default: the right floor is
    the slowest honest link's share of its parent's uplink, which only the operator knows
    (on loopback the tests throttle honest peers to 30 kB/s).

The manifest comes from the store (last source) unless the controller announced its
SHA-256, in which case any source may serve it. Reports and byte counts per source are in
the returned `FetchResult`; the worker forwards them to the controller in heartbeats.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from bridge.broadcast import chunks as chunks_lib
from bridge.store.layout import LAYOUT
from bridge.store.weight_store import Manifest, WeightStore

BAD_LIMIT = 2  # corrupt chunks from one source before it is dropped for the version
POLL_WAIT_S = 5.0  # how long a relay holds a request for a chunk it has not got yet
# Before the minimum rate counts: a parent's uplink serves its readers in turns
# (uplink.Uplink), so a chunk's first piece may wait behind the other children's.
MIN_RATE_GRACE_S = 2.0


class SourceDead(RuntimeError):
    """A source is unreachable, erroring or stalled."""


class NotHeld(LookupError):
    """A relay does not hold this key and will not (HTTP 410): ask the next source."""


class FetchError(RuntimeError):
    """A chunk (or the manifest) could not be had from any source."""


@dataclasses.dataclass(frozen=True)
class Source:
    """A relay ("relay": its base URL) or the weight store ("store": a WeightStore spec)."""

    kind: str
    where: Any

    @property
    def name(self) -> str:
        return self.where if self.kind == "relay" else "store"

    @classmethod
    def parse(cls, x) -> Source:
        if isinstance(x, Source):
            return x
        if isinstance(x, str) and x.startswith(("http://", "https://")):
            return cls("relay", x.rstrip("/"))
        return cls("store", x)


@dataclasses.dataclass
class FetchResult:
    version: int
    seconds: float = 0.0
    bytes_total: int = 0
    bytes_from_store: int = 0  # from the last source: the store (or the bench's origin)
    bytes_by_source: dict[str, int] = dataclasses.field(default_factory=dict)
    reports: list[dict] = dataclasses.field(default_factory=list)  # {source, kind, key}
    finished_at: float = 0.0  # time.monotonic() when the last chunk was verified

    @property
    def down_bytes_per_s(self) -> float:
        return self.bytes_total / self.seconds if self.seconds > 0 else 0.0


class Reader:
    """Reads store keys from one source; raises SourceDead, returns None for absent keys."""

    def __init__(
        self, source: Source, session: aiohttp.ClientSession, stall_s: float, min_rate=0.0
    ):
        self.source, self.session, self.stall_s = source, session, stall_s
        self.min_rate = min_rate  # bytes/s of a chunk's body, after the grace; 0 = off
        self.dead, self.bad = False, 0
        self._store = WeightStore(source.where) if source.kind == "store" else None

    async def read(self, key: str) -> bytes | None:
        if self._store is not None:
            try:
                r = await self._store.kv.read(key)
            except Exception as e:  # noqa: BLE001 - any store error: try the next source
                raise SourceDead(f"store read {key}: {e}") from e
            return r.value if r.state == "value" else None
        url, last_have, last_progress = f"{self.source.where}/kv/{key}", -1, time.monotonic()
        timeout = aiohttp.ClientTimeout(sock_connect=5, sock_read=self.stall_s)
        while True:
            try:
                wait = min(POLL_WAIT_S, self.stall_s)
                async with self.session.get(url, params={"wait": wait}, timeout=timeout) as r:
                    if r.status == 200:
                        return await self._body(r, url)
                    if r.status == 404:
                        return None
                    if r.status == 410:
                        raise NotHeld(url)
                    if r.status != 503:
                        raise SourceDead(f"{url}: HTTP {r.status}")
                    have = int(r.headers.get("X-Relay-Have", "-1"))
            except (TimeoutError, aiohttp.ClientError, ValueError) as e:
                raise SourceDead(f"{url}: {type(e).__name__}: {e}") from e
            now = time.monotonic()
            if have > last_have:  # the relay is making progress: keep waiting for it
                last_have, last_progress = have, now
            elif now - last_progress > self.stall_s:
                raise SourceDead(f"{url}: stalled ({have} chunks for {self.stall_s:.0f}s)")

    async def _body(self, r: aiohttp.ClientResponse, url: str) -> bytes:
        """The body; with a minimum rate, SourceDead once fewer than `min_rate` bytes/s
        have come since the grace: `got` bytes buy MIN_RATE_GRACE_S + got / min_rate
        seconds (no Content-Length needed: a hostile parent may send none, or lie)."""
        if self.min_rate <= 0:
            return await r.read()
        t0, got, parts = time.monotonic(), 0, []
        while True:
            left = t0 + MIN_RATE_GRACE_S + got / self.min_rate - time.monotonic()
            try:
                async with asyncio.timeout(max(0.0, left)):
                    part = await r.content.readany()
            except TimeoutError:
                raise SourceDead(
                    f"{url}: too slow ({got} bytes in {time.monotonic() - t0:.1f}s, "
                    f"below {self.min_rate:.0f} B/s)"
                ) from None
            if not part:
                return b"".join(parts)
            parts.append(part)
            got += len(part)


async def fetch_version(
    cache,
    version: int,
    sources: Sequence,
    session: aiohttp.ClientSession,
    manifest_sha256: str | None = None,
    stall_s: float = 30.0,
    concurrency: int = 4,
    whole: bool | None = None,
    min_rate: float = 0.0,
) -> FetchResult:
    """Fill `cache` (a relay's VersionCache) with `version`, every chunk verified.

    `whole` (chunks.chunk_plan): every chunk of a full version (default) or only a delta
    hop's keys (patches and dense tensors; the default for a delta version). `min_rate`:
    a relay's per-chunk minimum rate in bytes/s (module docstring; 0 = off).

    `cache` is told begin(version, manifest_bytes, manifest, plan) once the manifest is
    known, put(version, key, raw) per verified chunk and finish(version) at the end.
    """
    t0 = time.monotonic()
    readers = [Reader(Source.parse(s), session, stall_s, min_rate) for s in sources]
    if not readers:
        raise ValueError("no sources")
    result = FetchResult(version)

    def report(reader: Reader, kind: str, key: str, detail: str = "") -> None:
        result.reports.append(
            {"source": reader.source.name, "kind": kind, "key": key, "detail": detail[:200]}
        )

    async def get(key: str, check, order: list[Reader]) -> bytes | None:
        for reader in order:
            if reader.dead:
                continue
            try:
                raw = await reader.read(key)
            except NotHeld:
                continue
            except SourceDead as e:
                reader.dead = True
                report(reader, "dead", key, str(e))
                continue
            if not check(raw):
                reader.bad += 1
                report(reader, "corrupt", key)
                reader.dead = reader.bad >= BAD_LIMIT
                continue
            n = len(raw or b"")
            result.bytes_total += n
            result.bytes_by_source[reader.source.name] = (
                result.bytes_by_source.get(reader.source.name, 0) + n
            )
            if reader is readers[-1]:
                result.bytes_from_store += n
            return raw
        raise FetchError(f"version {version}: {key}: no source could serve it")

    mkey = LAYOUT.manifest_key(version)
    if manifest_sha256:
        check = lambda raw: raw is not None and chunks_lib.manifest_sha256(raw) == manifest_sha256
        try:
            manifest_bytes = await get(mkey, check, readers)
        except FetchError:
            raise FetchError(
                f"version {version}: no source serves the manifest with the announced sha256 "
                f"{manifest_sha256}; refused, nothing loaded"
            ) from None
    else:  # only the root of trust may hand us the manifest
        manifest_bytes = await get(mkey, lambda raw: raw is not None, readers[-1:])
    manifest = Manifest.model_validate_json(manifest_bytes)
    if manifest.version != version:
        raise FetchError(f"manifest of version {version} says version {manifest.version}")
    plan = chunks_lib.chunk_plan(version, manifest, whole)
    await cache.begin(version, manifest_bytes, manifest, plan)

    # Chunks in manifest order: the parent fetches in the same order, so what we ask for
    # next is what it receives next, and the pipeline stays one chunk deep per hop.
    queue: asyncio.Queue = asyncio.Queue()
    for spec in plan:
        queue.put_nowait(spec)

    async def worker() -> None:
        while not queue.empty():
            spec = queue.get_nowait()
            raw = await get(spec.key, lambda raw, s=spec: chunks_lib.chunk_ok(s, raw), readers)
            await cache.put(version, spec.key, raw)

    tasks = [asyncio.ensure_future(worker()) for _ in range(max(1, concurrency))]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
    await cache.finish(version)
    result.finished_at = time.monotonic()
    result.seconds = result.finished_at - t0
    return result


def sources_for(parent_url: str | None, fallback_urls: Sequence[str], store: Mapping | str) -> list:
    """The order the controller's instructions imply: parent, fallbacks, then the store.

    A peer URL is only ever a relay (issue 23 item 4): one that is not http(s) (`file://`,
    an object-store URL, a bare path) is dropped here, so `Source.parse` never reads it as
    a weight store; only `store` (the announcement's) may be one."""
    out = []
    for u in dict.fromkeys(u for u in (parent_url, *fallback_urls) if u):
        if isinstance(u, str) and u.startswith(("http://", "https://")):
            out.append(u)
        else:
            logging.warning("peer source %.200r is not an http(s) relay URL: ignored", u)
    return [*out, store]
