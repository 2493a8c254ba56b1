"""A rollout worker's side of the peer-assisted broadcast: its relay, its route, its reports.

The worker builds one `PeerSwap` (`--relay`, on by default in the binary) and hands it to
its `WeightVersions` (rollout_gpu/versions.py), which decides when to swap and asks this
module only what the relay is doing (`fetching`) and where to read from. Every heartbeat
and lease response says where to fetch the next version from (protocol `_Route`:
broadcast_mode, relay_parent, relay_fallbacks); `store_for(announcement)` then returns the
store object `weight_swap.load_version` reads:
  * mode "store" (the default): the announced WeightStore itself, today's path unchanged;
  * "chain"/"tree": the relay's verified local copy, after `Relay.fetch` pulled the version
    chunk by chunk from the parent, the fallbacks, then the store (rollout_gpu/peer_fetch.py),
    serving each verified chunk onward meanwhile. If that fetch fails outright, the worker
    reads the store directly, as before.
Either way load_version verifies every array checksum again and runs the canary: only
where the bytes come from changes. The announcement's manifest SHA-256 goes with every
fetch: a relay copy whose manifest differs (begun on another peer's instruction) is refused
and dropped, and the worker reads the store. A delta version (bridge/weights/delta.py) comes through
the relay too: the relay fetches what the worker, serving version `have()` (WeightVersions sets it),
needs to rebuild it (the patches after `have`, or the anchor whole and the patches after it:
rollout_gpu/relay_cache.py), and load_version rebuilds from the relay's copy with the same `have`. A
version whose load from the relay's copy failed is read from the store the next time (the root of
trust; a relay copy that cannot rebuild it is not retried).
Heartbeats carry the relay URL, the measured rates and a BroadcastReport of the last fetch
(bad sources, bytes from store vs peers).
"""

from __future__ import annotations

import threading
import time

from absl import logging

from bridge.control.protocol import BroadcastReport, SourceReport, VersionAnnouncement
from bridge.store.weight_store import WeightStore
from rollout_gpu import peer_fetch
from rollout_gpu.relay import Relay


class PeerSwap:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_url: str = "",
        keep_versions: int = 3,
        stall_s: float = 30.0,
        min_rate: float = 0.0,
    ):
        self.relay = Relay(
            host=host, port=port, advertise_url=advertise_url or None,
            keep_versions=keep_versions, stall_s=stall_s, min_rate=min_rate,
        )  # fmt: skip
        self.url = self.relay.start()
        self.mode, self.parent, self.fallbacks = "store", None, []
        self.down_bytes_per_s = 0.0
        self._report: tuple[float, dict] | None = None  # (monotonic done time, fields)
        self._prefetched = -1
        # (version, the `have` it was fetched for, Future) of the last `prefetch`
        self._inflight: tuple[int, int | None, object] | None = None
        self.have = lambda: None  # the version the worker serves (its base for a delta)
        self._from_relay = -1  # the version store_for last handed out as the relay's copy
        self.route_version: int | None = None  # the version the route was given for
        self._lock = threading.Lock()

    def note_route(self, response) -> None:
        """Take the route from any heartbeat, lease or submit response (each carries the
        route for the version it announces), and start fetching a newly announced version at
        once: children wait on this relay, and the worker itself only swaps between leases
        (`store_for` then joins the fetch in flight)."""
        ann = getattr(response, "announcement", None)
        with self._lock:
            self.mode = getattr(response, "broadcast_mode", "store") or "store"
            self.parent = getattr(response, "relay_parent", None)
            self.fallbacks = list(getattr(response, "relay_fallbacks", None) or [])
            self.route_version = ann.version if ann is not None else None
        if ann is not None:
            self.prefetch(ann)

    def prefetch(self, ann: VersionAnnouncement) -> None:
        """Start fetching `ann.version` through the relay on the route last heard, unless the
        route is the store or that version's fetch was started already. The worker also
        calls it for versions it heard of elsewhere (a submit reply carries announcements)."""
        with self._lock:
            if self.mode == "store" or ann.store is None or ann.version <= self._prefetched:
                return
            self._prefetched = ann.version
            sources = peer_fetch.sources_for(self.parent, self.fallbacks, ann.store)
        sha, have = ann.manifest_sha256, self.have()
        fut = self.relay.fetch_async(ann.version, sources, sha, have=have)
        with self._lock:
            self._inflight = (ann.version, have, fut)

        def done(f) -> None:  # the relay has it: that is "has the version" for the metric
            if f.cancelled():  # the relay stopped
                return
            if f.exception() is not None:
                logging.warning("prefetch of version %d failed: %s", ann.version, f.exception())
            else:
                self._record(f.result())

        fut.add_done_callback(done)

    def fetching(self, version: int) -> bool:
        """A background fetch of `version` (started by `prefetch`) is still running: the
        worker may keep generating on its current version instead of waiting for it."""
        with self._lock:
            inflight = self._inflight
        return inflight is not None and inflight[0] == version and not inflight[2].done()

    def _prefetch_of(self, version: int, have: int | None):
        """The Future of `prefetch`'s fetch of `version` for this `have`, unless it failed:
        one fetch of a version, so one report counting every byte of it (a second fetch
        running beside it counts only what the first had not brought yet)."""
        with self._lock:
            inflight = self._inflight
        if inflight is None or inflight[:2] != (version, have):
            return None
        fut = inflight[2]
        if fut.done() and (fut.cancelled() or fut.exception() is not None):
            return None
        return fut

    def store_for(self, ann: VersionAnnouncement):
        """The store to load `ann.version` from (fetched through the relay when routed)."""
        direct = WeightStore(ann.store)
        with self._lock:
            mode, parent, fallbacks = self.mode, self.parent, list(self.fallbacks)
            route_version = self.route_version
        t0 = time.monotonic()
        if mode != "store" and route_version != ann.version and not self.fetching(ann.version):
            # The route was given for another version: the fleet fetches this one on its
            # own route, and fetching it on ours can make our parent and us wait on each
            # other (a cycle until `stall_s`). The store is always a correct source.
            logging.info("version %d: route heard for version %s; reading the store",
                         ann.version, route_version)  # fmt: skip
            mode = "store"
        if mode == "store":

            def read(counts: dict) -> None:
                now = time.monotonic()
                self._done(ann.version, now, now - t0, counts, [])

            return _ReportingStore(direct, read)
        if self._from_relay == ann.version:  # its load from the relay's copy failed
            logging.warning("version %d: reading the store, not the relay", ann.version)
            return direct
        sources = peer_fetch.sources_for(parent, fallbacks, direct.spec)
        try:  # joins the prefetch that note_route started, if any
            sha, have = ann.manifest_sha256, self.have()  # a copy of another manifest: refused
            fut = self._prefetch_of(ann.version, have)
            if fut is None:
                fut = self.relay.fetch_async(ann.version, sources, sha, have=have)
            result = fut.result()
        except Exception as e:  # noqa: BLE001 - the direct read below is today's path
            logging.warning(
                "peer fetch of version %d failed (%s); reading the store", ann.version, e
            )
            return direct
        self._record(result)
        self._from_relay = ann.version
        return self.relay.store

    def _record(self, result: peer_fetch.FetchResult) -> None:
        if result.finished_at <= 0:  # a cached result of a version held before: nothing new
            return
        if result.seconds > 0:
            self.down_bytes_per_s = result.down_bytes_per_s
        # One report per (source, kind), naming the first bad chunk: the controller checks it.
        bad = list({(r["source"], r["kind"]): r["key"] for r in reversed(result.reports)}.items())
        if bad:
            logging.warning("version %d: bad sources %s", result.version, bad)
        counts = {
            "bytes_from_store": result.bytes_from_store,
            "bytes_from_peers": result.bytes_total - result.bytes_from_store,
        }
        self._done(result.version, result.finished_at, result.seconds, counts, bad)

    def _done(self, version: int, at: float, fetch_s: float, counts: dict, bad: list) -> None:
        fields = dict(
            version=version,
            fetch_s=fetch_s,
            bad_sources=[SourceReport(source=s, kind=k, key=key) for (s, k), key in bad[:64]],
            **counts,
        )
        with self._lock:
            if self._report is None or self._report[1]["version"] <= version:
                self._report = (at, fields)

    def heartbeat_fields(self) -> dict:
        """Optional Heartbeat fields: relay URL, measured rates, the last fetch's report."""
        with self._lock:
            report = self._report
        out = {
            "relay_url": self.url,
            "up_bytes_per_s": self.relay.up_bytes_per_s,
            "down_bytes_per_s": self.down_bytes_per_s,
        }
        if report is not None:
            done, fields = report
            ago = max(0.0, time.monotonic() - done)
            out["broadcast"] = BroadcastReport(fetched_ago_s=ago, **fields)
        return out

    def close(self) -> None:
        self.relay.stop()


class _ReportingStore:
    """The announced store as load_version reads it, reporting the fetch once `read_all`
    (which verifies every checksum) has returned: store mode's "has the version" time."""

    def __init__(self, store: WeightStore, on_read):
        self.store, self.on_read = store, on_read

    def manifest(self, version: int):
        return self.store.manifest(version)

    def read_all(self, version: int, names=None):
        out = self.store.read_all(version, names)
        self.on_read({"bytes_from_store": sum(a.nbytes for a in out.values())})
        return out

    def __getattr__(self, name):
        # The rest is the store's own: a delta version is rebuilt through `read_stored`,
        # `kv` and the manifests of its links (bridge/weights/delta_reconstruct.py).
        return getattr(self.store, name)
