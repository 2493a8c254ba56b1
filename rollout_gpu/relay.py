"""Weight relay: serves the versions this worker holds to its peers, chunk by chunk, while
it is still fetching them (pipelined broadcast, PAPER.md idea 4).

    python -m rollout_gpu.relay --port=0 --url_file=/tmp/relay.url [--up_mbps=50]

Every rollout worker runs one in a background thread (`Relay`); the command above runs
one standalone (benchmarks, tests: no vLLM), with the control endpoints on.

HTTP (read-only for peers; the key layout is the weight store's own, so a relay is a
read-through mirror of the store for the versions it holds):
    GET  /kv/{key}?wait=S   the key's bytes once verified here; 404 if the key is absent
                            (an all-zero chunk, or not a key of the version); after S
                            seconds without it: 503 with `X-Relay-Have: <chunks held>`;
                            410 for a key it will not hold (a version older than its
                            newest that it never began, an anchor held as its patch only)
    GET  /status            versions held, bytes served, measured rates
    POST /fetch, /forget    standalone only (`control=True`): {"version", "sources",
                            "manifest_sha256"} (the hash the controller announced: a
                            manifest that differs is refused, 409 if held already)

A chunk enters the relay's cache only after it matched the manifest's per-chunk digest
(rollout_gpu/peer_fetch.py), and is checked again when served, so bytes corrupted in
this relay's memory are dropped and refetched rather than passed on. zarr.json metadata
is rebuilt locally from the manifest, never copied from a peer. The cache is a
WeightStore (a `memory` kvstore by default) whose manifest is written last, so the
worker swaps from it through the unchanged verified path (`weight_swap.load_version`).
Delta versions (bridge/weights/) travel the same way, key by key: their patches (a patch
larger than a chunk as its chunk-sized pieces, each verified and re-served on its own) and
dense tensors, or what a worker needs to catch up (`fetch_async(..., have=)`, relay_cache.py).
Uploads go through a token bucket (`up_bytes_per_s`, rollout_gpu/uplink.py), used by the
bench to model links.

Hostile peers: parameters checked first (bridge/broadcast/relay_params.py, else 400); a
response gets `max_send_s` in all and `read_stall_s` per piece (uplink.send); past
`max_clients` /kv requests in flight, `max_readers` peer addresses or `per_reader` requests
of one address: 429. Peers share the uplink fairly (uplink.Uplink): a peer that does not
read holds nothing another peer waits on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Sequence

import aiohttp
from absl import app, flags, logging
from aiohttp import web

from bridge.broadcast import chunks as chunks_lib
from bridge.broadcast import relay_params as params
from bridge.control.trust.log_text import log_safe
from bridge.store import weight_store as ws
from bridge.store.layout import LAYOUT
from rollout_gpu import peer_fetch, uplink
from rollout_gpu.relay_cache import CachedVersion, VersionCache
from rollout_gpu.uplink import PIECE, TokenBucket

__all__ = ["PIECE", "Relay", "TokenBucket"]

MAX_WAIT_S = 30.0


class ManifestMismatch(peer_fetch.FetchError):
    """A version's manifest is not the one announced (its SHA-256 differs)."""


class Relay(VersionCache):
    """A relay + fetcher with its own event loop thread; `fetch` blocks its caller."""

    def __init__(
        self,
        mirror: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        up_bytes_per_s: float = 0.0,
        up_burst_bytes: float = 4 * PIECE,
        keep_versions: int = 4,
        stall_s: float = 30.0,
        concurrency: int = 4,
        control: bool = False,
        advertise_url: str | None = None,
        tamper: Callable[[str, bytes], bytes] | None = None,
        max_send_s: float = 30.0,
        max_clients: int = 64,
        max_readers: int = 32,
        per_reader: int = 8,
        read_stall_s: float = 5.0,
        min_rate: float = 0.0,
    ):
        self.mirror = ws.WeightStore(mirror or f"memory://relay-{uuid.uuid4().hex}")
        self.host, self.port, self.control = host, port, control
        self.keep_versions, self.stall_s, self.concurrency = keep_versions, stall_s, concurrency
        self.min_rate = min_rate  # a source's per-chunk minimum bytes/s (peer_fetch.py)
        self.advertise_url, self.tamper = advertise_url, tamper
        self.max_send_s, self.max_clients, self.clients = max_send_s, max_clients, 0
        self.bucket = TokenBucket(up_bytes_per_s, up_burst_bytes) if up_bytes_per_s > 0 else None
        self._slots = (max_readers, per_reader, read_stall_s)  # the Uplink, made on the loop
        self.versions: dict[int, CachedVersion] = {}
        self.results: dict[int, peer_fetch.FetchResult] = {}
        self.errors: dict[int, str] = {}  # version -> why a POST /fetch of it failed
        self.bytes_up, self.busy_s = 0, 0.0
        self.url = ""
        self._tasks: dict[int, asyncio.Task] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None

    @property
    def store(self) -> ws.WeightStore:
        """The verified local copy: complete versions only (manifest written last)."""
        return self.mirror

    @property
    def up_bytes_per_s(self) -> float:
        """Measured: bytes served per second while serving (0 until it has served)."""
        return self.bytes_up / self.busy_s if self.busy_s > 0.05 else 0.0

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> str:
        ready = concurrent.futures.Future()
        threading.Thread(target=self._thread, args=(ready,), daemon=True, name="relay").start()
        self.url = ready.result(timeout=30)
        return self.url

    def _thread(self, ready) -> None:
        # The thread keeps its own reference: start() returns as soon as the site is up, so
        # a stop() may clear self._loop before this thread reaches run_forever (its close
        # coroutine then runs once the loop does).
        loop = self._loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._serve(ready))
        except BaseException as e:  # noqa: BLE001 - hand a startup failure to start()
            if not ready.done():
                ready.set_exception(e)
            return
        loop.run_forever()

    async def _serve(self, ready) -> None:
        self._changed = asyncio.Event()
        self.uplink = uplink.Uplink(self.bucket, *self._slots)
        self.session = aiohttp.ClientSession()
        routes = [web.get("/kv/{key:.+}", self._get), web.get("/status", self._status)]
        if self.control:
            routes += [web.post("/fetch", self._post_fetch), web.post("/forget", self._forget)]
        webapp = web.Application()
        webapp.add_routes(routes)
        self._runner = web.AppRunner(webapp, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        ready.set_result(self.advertise_url or f"http://{self.host}:{port}")

    def stop(self) -> None:
        """Stop serving and fetching (idempotent); a fetch in flight raises in its caller."""
        loop, self._loop = self._loop, None
        if loop is None:
            return

        async def close():
            for task in self._tasks.values():
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            await self._runner.cleanup()
            await self.session.close()

        asyncio.run_coroutine_threadsafe(close(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)

    # -- fetching -----------------------------------------------------------------------
    def fetch(
        self, version: int, sources: Sequence, manifest_sha256: str | None = None, timeout=None,
        whole: bool | None = None,
    ) -> peer_fetch.FetchResult:  # fmt: skip
        """Fetch `version` (parent first, the store last) into the cache; blocks. `whole`:
        chunks.chunk_plan's (default: a full version whole, a delta version's hop)."""
        coro = self._fetch(version, list(sources), manifest_sha256, whole)
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def fetch_async(self, version: int, sources: Sequence, manifest_sha256=None, have=None):
        """Start (or join) the fetch of what a worker serving version `have` (None: no copy)
        needs to rebuild `version` (relay_cache.fetch_chain); a concurrent.futures.Future."""
        coro = self.fetch_chain(version, list(sources), have, manifest_sha256)
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    async def _fetch(self, version, sources, manifest_sha256=None, whole=None):
        result = await self._fetch_any(version, sources, manifest_sha256, whole)
        if manifest_sha256:
            await self._check_manifest(version, manifest_sha256)
        return result

    async def _check_manifest(self, version: int, manifest_sha256: str) -> None:
        """The copy held for `version` is the announced one, or it is dropped: a copy begun
        on another instruction (another sha, or none: a peer's POST /fetch naming its own
        store) is never handed to a worker told to expect `manifest_sha256`."""
        st = self.versions.get(version)
        got = chunks_lib.manifest_sha256(st.manifest_bytes) if st is not None else None
        if got is not None and got != manifest_sha256:
            task = self._tasks.pop(version, None)
            if task is not None and not task.done():
                task.cancel()
            await self._drop(version)
            raise ManifestMismatch(
                f"version {version}: the manifest held has sha256 {got}, not the announced "
                f"{manifest_sha256}; refused and dropped, nothing loaded"
            )

    async def _fetch_any(self, version, sources, manifest_sha256=None, whole=None):
        if self.holds(version, whole):
            return self.results.get(version) or peer_fetch.FetchResult(version)
        task = self._tasks.get(version)
        if task is not None and not task.done() and whole:
            await asyncio.gather(task, return_exceptions=True)  # a hop: whole needs more
            if self.holds(version, whole):
                return self.results.get(version) or peer_fetch.FetchResult(version)
        if task is None or task.done() or whole:
            task = asyncio.ensure_future(
                peer_fetch.fetch_version(
                    self, version, sources, self.session, manifest_sha256, self.stall_s,
                    self.concurrency, whole, self.min_rate,
                )
            )  # fmt: skip
            self._tasks[version] = task
        try:
            result = await asyncio.shield(task)
        except Exception as e:
            st = self.versions.get(version)
            if st is not None:
                st.failed = f"{type(e).__name__}: {e}"
                self._notify()
            raise
        self.results[version] = result
        return result

    def _notify(self) -> None:
        self._changed.set()  # wakes every waiter holding this event
        self._changed = asyncio.Event()

    # -- serving ------------------------------------------------------------------------
    async def _lookup(self, key: str) -> tuple[int, bytes | None]:
        """(HTTP status, body) for a key now; status 0 = not here yet."""
        version = LAYOUT.version_of(key)
        st = self.versions.get(version) if version is not None else None
        if version is None:
            return 404, None
        if st is None:  # not begun: it may be soon, unless older than what is held
            return (410, None) if version < max(self.versions, default=-1) else (0, None)
        if st.failed:
            return 502, None
        if key == LAYOUT.manifest_key(version):
            return 200, st.manifest_bytes
        if key.endswith("/zarr.json"):
            r = await self.mirror.kv.read(key)
            return (200, r.value) if r.state == "value" else (404, None)
        if key in st.absent:
            return 404, None
        if key not in st.plan:  # no such key, or an anchor held as its patch only: ask on
            return (404, None) if st.every_key else (410, None)
        if key not in st.have:
            return 0, None
        raw = (await self.mirror.kv.read(key)).value
        if not chunks_lib.chunk_ok(st.plan[key], raw):  # rotted here: never pass it on
            # Children fall back; the next fetch of the version starts it over.
            logging.error("relay: cached chunk %s fails its digest; dropping the version", key)
            st.failed, st.complete = f"cached chunk {key} corrupt", False
            if version in self._tasks:
                self._tasks[version].cancel()
            await self.mirror.kv.write(LAYOUT.manifest_key(version), None)
            return 502, None
        return 200, raw

    async def _get(self, request: web.Request) -> web.StreamResponse:
        try:
            key = params.key(request.match_info["key"])
            wait = params.wait_s(request.query.get("wait"), MAX_WAIT_S)
        except params.BadParam as e:
            return web.Response(status=400, text=str(e))
        reader = request.remote or ""
        if self.clients >= self.max_clients or not self.uplink.admit(reader):
            return web.Response(status=429, headers={"Retry-After": "1"})
        self.clients += 1
        try:
            return await self._answer(request, key, wait)
        finally:
            self.clients -= 1
            self.uplink.release(reader)

    async def _answer(self, request: web.Request, key: str, wait: float):
        deadline = time.monotonic() + wait
        while True:
            status, body = await self._lookup(key)
            remaining = deadline - time.monotonic()
            if status or remaining <= 0:
                break
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                pass
        if status == 0:
            st = self.versions.get(LAYOUT.version_of(key))
            have = len(st.have) + len(st.absent) if st else 0
            return web.Response(status=503, headers={"X-Relay-Have": str(have)})
        if status != 200:
            return web.Response(status=status)
        if self.tamper is not None:
            body = self.tamper(key, body)
        return await self._send(request, body)

    async def _send(self, request: web.Request, body: bytes) -> web.StreamResponse:
        def tally(sent: int, seconds: float) -> None:
            self.bytes_up, self.busy_s = self.bytes_up + sent, self.busy_s + seconds

        return await uplink.send(request, body, self.uplink, self.max_send_s, tally)

    def status(self) -> dict:
        versions = {
            str(v): {
                "have": len(s.have) + len(s.absent),
                "total": len(s.plan),
                "complete": s.complete,
                "failed": s.failed,
                "started_at": s.started_at,
                "completed_at": s.completed_at,
            }
            for v, s in list(self.versions.items())
        }
        results = {str(v): dataclasses.asdict(r) for v, r in list(self.results.items())}
        return {
            "url": self.url,
            "versions": versions,
            "results": results,
            "bytes_up": self.bytes_up,
            "up_bytes_per_s": self.up_bytes_per_s,
            "clients": self.clients,
            "errors": {str(v): e for v, e in list(self.errors.items())},
        }

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status())

    async def _body(self, request: web.Request, parse):
        try:
            return parse(await request.json())
        except ValueError as e:  # BadParam, or not JSON at all
            raise web.HTTPBadRequest(text=str(e)[:200]) from None

    async def _post_fetch(self, request: web.Request) -> web.Response:
        version, sources, sha = await self._body(request, params.fetch_body)
        try:  # a copy held already: answered now (the fetch below would only join it)
            await self._check_manifest(version, sha)
        except ManifestMismatch as e:
            return web.json_response({"ok": False, "error": str(e)}, status=409)

        async def run():
            try:
                await self._fetch(version, sources, sha)
            except Exception as e:  # noqa: BLE001 - recorded in status; logged here
                logging.error("relay: fetch of version %d failed: %s", version, log_safe(e))
                self.errors[version] = str(e)[:500]
                while len(self.errors) > 16:
                    del self.errors[min(self.errors)]

        asyncio.ensure_future(run())
        return web.json_response({"ok": True}, status=202)

    async def _forget(self, request: web.Request) -> web.Response:
        await self._drop(await self._body(request, params.version))
        return web.json_response({"ok": True})


_PORT = flags.DEFINE_integer("port", 0, "port to serve on (0 = any free port)")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "address to bind")
_UP = flags.DEFINE_float("up_mbps", 0.0, "upload limit in MB/s (1e6 bytes); 0 = none")
_BURST = flags.DEFINE_integer(
    "up_burst_kb", 4 * PIECE >> 10, "upload token bucket burst in KiB (>= one 256 KiB piece)"
)
_URL_FILE = flags.DEFINE_string("url_file", "", "write the relay's URL here once serving")
_STALL = flags.DEFINE_float("stall_s", 30.0, "a source without progress this long is dead")


def main(argv):
    del argv
    relay = Relay(
        host=_HOST.value,
        port=_PORT.value,
        up_bytes_per_s=_UP.value * 1e6,
        up_burst_bytes=max(PIECE, _BURST.value << 10),
        stall_s=_STALL.value,
        control=True,
    )
    url = relay.start()
    if _URL_FILE.value:
        with open(_URL_FILE.value + ".tmp", "w") as f:
            f.write(url)
        import os

        os.replace(_URL_FILE.value + ".tmp", _URL_FILE.value)
    print(url, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    app.run(main)
