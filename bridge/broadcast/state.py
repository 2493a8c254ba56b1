"""Controller-side broadcast bookkeeping: relay topology from heartbeats, routing answers,
bad-parent reports, and the `broadcast/*` metrics.

Workers send, in each heartbeat, their relay URL, measured up/down rates and a report of
their last fetch (protocol.BroadcastReport: which version, how long ago it completed,
bytes from the store vs peers, sources that served corrupt bytes or died). The controller
answers every heartbeat and lease with the worker's parent relay and fallbacks (topology.py).

Trust: a report is a worker's claim. A corrupt-bytes report counts once per (reporter,
version, source), only for a published version, only for a source this controller routed
that reporter to for that version (a worker cannot accuse a relay it never fetched from),
and only if it names the chunk (`SourceReport.key`). It is answered by re-verifying that
chunk (issue 23 item 2, report_check.py: the relay's bytes against the digest in the
store's manifest): proven corrupt, the relay is excluded at once (it keeps receiving
versions but never relays again); proven false, the report is withdrawn and costs the
reporter: one that falsely accused `bad_limit` distinct relays is itself excluded from
relaying and its reports are ignored. Unverifiable (the relay did not answer, the version
is gone, no checker): a relay named by `bad_limit` distinct reporters is excluded, so one
lying child alone excludes no one.
Dead-parent reports only mark the parent suspect until its next heartbeat: a relay that
is really gone stops heartbeating and is dropped after `worker_timeout_s`.

Placement by measured delivery (topology.rank_rate): a report's bytes from peers over its
fetch time is what the reporter received while routed to its parent; the parent's
`delivered_bytes_per_s` is the lowest of its children's for the newest version they
reported (0 when a child routed to it got nothing from peers). A delivery report is a
claim the controller cannot check byte for byte, so no child can raise its parent above
what another child of it measured: a Sybil child claiming 1e12 B/s for a relay that
served its honest sibling nothing leaves that relay at 0 (the worst a lying child can do
is lower its own parent, which then feeds fewer; it never puts a relay that serves
nothing above one that serves). A worker's declared uplink only caps the measured rate
and places no one: until a child has measured it, a worker hangs behind every relay that
has delivered, a leaf (topology.py). A worker no child has measured yet is measured by the
controller itself once it reports holding a version: one chunk read from its relay, timed
and checked against the store's manifest (report_check.probe_uplink; a corrupt one is proof,
as for a report), credited like a child's report. A relay measured to deliver nothing is
probed again every `_REPROBE_VERSIONS` versions, so a passing fault does not bench it for
good.

Delta versions (bridge/weights/) put a few % of the model on each link: a fetch that small
is dominated by per-request latency, so its bytes / seconds says little about the uplink
(a lower bound only). A parent's rate measured on a full version (an anchor) is therefore
kept when a newer report carries a payload under a quarter of that one's and a lower rate
(it would rank the parents measured on a delta below those still measured on an anchor);
a higher rate, a comparable payload, nothing from peers at all, or a measurement older
than `_STALE_VERSIONS` replaces it.

Metrics (for the newest version every live reporting worker has fetched, measured on
the controller's clock: completion = heartbeat arrival - fetched_ago_s; workers that
never send a report, e.g. without a relay, are not waited for):
  broadcast/latency_s    publish -> the last live worker has verified the version
  broadcast/store_bytes  bytes read from the store for that version, summed over workers
State is in memory: after a controller restart the topology is rebuilt from heartbeats.
"""

from __future__ import annotations

import collections
import logging
import threading

from bridge.broadcast import topology as topo

_MAX_VERSIONS = 64  # versions whose reports are kept for the metrics
_STALE_VERSIONS = 32  # a rate measured this many versions ago yields to any newer one
_REPROBE_VERSIONS = 8  # a relay measured to deliver nothing is probed again this often


class BroadcastState:
    def __init__(self, mode: str = "store", fanout: int = 2, bad_limit: int = 2,
                 worker_timeout_s: float = 30.0, checker=None, prober=None):  # fmt: skip
        self.topology = topo.Topology(mode, fanout)
        self.bad_limit, self.worker_timeout_s = bad_limit, worker_timeout_s
        self.checker = checker  # report_check.ReportChecker; None: reports are unverifiable
        # A ReportChecker running report_check.probe_uplink; None: only children measure.
        self.prober = prober
        self.probed: dict[str, int] = {}  # worker -> the version its relay was last probed on
        self.stores: dict[int, object] = {}  # version -> the store spec it was published to
        self.false_by: dict[str, set] = collections.defaultdict(set)  # reporter -> {relay}
        self.ignored: set[str] = set()  # reporters whose reports no longer count
        self.false_reports = self.proven_corrupt = 0
        self.lock = threading.Lock()
        self.last_seen: dict[str, float] = {}
        self.suspect: set[str] = set()
        self.by_url: dict[str, str] = {}  # relay URL -> worker id
        self.corrupt: dict[str, set] = collections.defaultdict(set)  # worker -> {(rep, v)}
        self.published: dict[int, float] = {}
        self.done: dict[int, dict[str, float]] = collections.defaultdict(dict)  # v -> w -> t
        self.store_bytes: dict[int, dict[str, int]] = collections.defaultdict(dict)
        self.peer_bytes: dict[int, dict[str, int]] = collections.defaultdict(dict)
        self.reporters: set[str] = set()  # workers that fetch through PeerSwap (report)
        self.corrupt_reports = 0
        self._rebuild_for: int = -1
        self._published_since_rebuild = False
        self._pruned_at = float("-inf")
        # (worker, version) -> every relay URL routed to it for that version (parent first)
        self.routed: dict[tuple[str, int], list[str]] = {}
        # parent -> (version, bytes/s, payload bytes of the fetch it was measured on)
        self.delivery: dict[str, tuple[int, float, int]] = {}

    @property
    def mode(self) -> str:
        return self.topology.mode

    def publish(self, version: int, published_at: float, store=None) -> None:
        """`store`: the spec the version was published to (corrupt reports are checked
        against its manifest there)."""
        with self.lock:
            self.published[version] = published_at
            self.stores[version] = store
            self._published_since_rebuild = True
            for old in sorted(self.published)[:-_MAX_VERSIONS]:
                for d in (self.published, self.done, self.store_bytes, self.peer_bytes,
                          self.stores):  # fmt: skip
                    d.pop(old, None)
            oldest = min(self.published)
            self.routed = {k: v for k, v in self.routed.items() if k[1] >= oldest}

    def heartbeat(self, worker_id: str, hb, now: float) -> None:
        """Record a heartbeat's broadcast fields (protocol.Heartbeat)."""
        with self.lock:
            if now - self._pruned_at >= 1.0:  # O(fleet): once a second, not per heartbeat
                self._prune(now)
            self.last_seen[worker_id] = now
            self.suspect.discard(worker_id)
            url = getattr(hb, "relay_url", "") or ""
            node = self.topology.nodes.get(worker_id) or topo.Node(worker_id)
            node.relay_url = url
            node.up_bytes_per_s = getattr(hb, "up_bytes_per_s", 0.0) or node.up_bytes_per_s
            node.down_bytes_per_s = getattr(hb, "down_bytes_per_s", 0.0) or node.down_bytes_per_s
            if url:
                self.by_url[url] = worker_id
                self.topology.join(node)  # new: attaches at a leaf
            rep = getattr(hb, "broadcast", None)
            if rep is None:
                return
            self.reporters.add(worker_id)
            if rep.version not in self.published:
                return  # a version never published: nothing in it counts
            self.done[rep.version].setdefault(worker_id, now - rep.fetched_ago_s)
            self.store_bytes[rep.version][worker_id] = rep.bytes_from_store
            self.peer_bytes[rep.version][worker_id] = rep.bytes_from_peers
            routed = self.routed.get((worker_id, rep.version), [])
            if routed and rep.fetch_s > 0:
                self._delivered(self.by_url.get(routed[0]), rep)
            self._probe(worker_id, rep.version)
            for bad in rep.bad_sources:
                bad_id = self.by_url.get(bad.source)
                if bad_id is None or bad_id == worker_id:
                    continue
                if bad.kind != "corrupt":
                    self.suspect.add(bad_id)
                    continue
                if bad.source not in routed or not bad.key or worker_id in self.ignored:
                    continue  # never fetched that version there / no chunk named / a liar
                if (worker_id, rep.version) not in self.corrupt[bad_id]:
                    self.corrupt[bad_id].add((worker_id, rep.version))
                    self.corrupt_reports += 1
                    self._check(worker_id, bad_id, bad.source, rep.version, bad.key)

    def _check(self, reporter: str, accused: str, url: str, version: int, key: str) -> None:
        """Re-verify the accused chunk off the heartbeat's path (report_check.py)."""

        def done(verdict: str) -> None:
            with self.lock:
                self._verdict(reporter, accused, version, verdict)

        store = self.stores.get(version)
        if (
            self.checker is None
            or store is None
            or not self.checker.submit(store, url, version, key, done)
        ):
            self._verdict(reporter, accused, version, "unknown")

    def _verdict(self, reporter: str, accused: str, version: int, verdict: str) -> None:
        if verdict == "corrupt":  # proof: the relay serves bytes that fail the digest
            self.proven_corrupt += 1
            self.topology.exclude(accused)
            logging.warning("relay of %s serves corrupt chunks (checked): relays no more", accused)
        elif verdict in ("ok", "no_chunk"):  # a false report: withdrawn, held against its maker
            self.corrupt[accused].discard((reporter, version))
            self.false_reports += 1
            self.false_by[reporter].add(accused)
            if len(self.false_by[reporter]) >= self.bad_limit and reporter not in self.ignored:
                self.ignored.add(reporter)
                self.topology.exclude(reporter)
                logging.warning("%s made false corrupt-chunk reports: ignored, relays no more",
                                reporter)  # fmt: skip
        # Unverifiable: distinct reporters, so one worker alone cannot exclude a relay.
        elif len({r for r, _ in self.corrupt[accused]}) >= self.bad_limit:
            self.topology.exclude(accused)

    def _delivered(self, parent: str | None, rep) -> None:
        """Credit the reporter's measured receive rate to the parent it was routed to (the
        lowest of the children's for one version: module docstring)."""
        rate = rep.bytes_from_peers / rep.fetch_s
        payload = rep.bytes_from_peers + rep.bytes_from_store
        self._credit(parent, rep.version, rate, payload)

    def _credit(self, parent: str | None, version: int, rate: float, payload: int) -> None:
        node = self.topology.nodes.get(parent) if parent else None
        if node is None:
            return
        v, best, held = self.delivery.get(parent, (-1, 0.0, 0))
        newer = version > v and (
            4 * payload >= held  # a payload of the same order: like for like
            or rate >= best  # a small payload's rate is a lower bound: it is at least this
            or rate == 0  # delivered nothing at all
            or version - v >= _STALE_VERSIONS
        )
        if newer or (version == v and rate < best):
            self.delivery[parent] = (version, rate, payload)
            node.delivered_bytes_per_s = rate

    def _probe(self, worker_id: str, version: int) -> None:
        """Have the controller measure `worker_id`'s relay on `version` (which it reports
        holding) when no child has measured it to deliver: a newcomer once per version until
        measured, one measured to deliver nothing every `_REPROBE_VERSIONS` versions."""
        node = self.topology.nodes.get(worker_id)
        if self.prober is None or node is None or not node.relay_url:
            return
        rate = topo.rank_rate(node)
        last = self.probed.get(worker_id)
        if worker_id in self.topology.excluded or (rate or 0.0) > 0:
            return
        if last is not None and version - last < (1 if rate is None else _REPROBE_VERSIONS):
            return
        store, url = self.stores.get(version), node.relay_url
        if store is None:
            return
        self.probed[worker_id] = version

        def done(result) -> None:
            with self.lock:
                self._probe_result(worker_id, url, version, result)

        self.prober.submit(store, url, version, "", done)  # full: tried on a later version

    def _probe_result(self, worker_id: str, url: str, version: int, result) -> None:
        node = self.topology.nodes.get(worker_id)
        if node is None or node.relay_url != url or isinstance(result, str):
            return  # gone, moved, or the probe itself failed ("unknown")
        verdict, rate, nbytes = result
        if verdict == "corrupt":  # proof, as for a checked report
            self.proven_corrupt += 1
            self.topology.exclude(worker_id)
            logging.warning("relay of %s served the controller a corrupt chunk: relays no more",
                            worker_id)  # fmt: skip
        elif verdict == "ok":
            self._credit(worker_id, version, rate, nbytes)

    def leave(self, worker_id: str) -> None:
        with self.lock:
            self._forget(worker_id)

    def _forget(self, worker_id: str) -> None:
        self.topology.remove(worker_id)
        self.delivery.pop(worker_id, None)
        self.probed.pop(worker_id, None)
        self.reporters.discard(worker_id)
        self.last_seen.pop(worker_id, None)
        self.suspect.discard(worker_id)

    def _prune(self, now: float) -> None:
        self._pruned_at = now
        for w, t in list(self.last_seen.items()):
            if now - t > self.worker_timeout_s:
                self._forget(w)

    def route(self, worker_id: str, newest_version: int) -> dict:
        """The optional response fields telling `worker_id` where to fetch from."""
        with self.lock:
            if self.mode == "store" or worker_id not in self.topology.nodes:
                return {"broadcast_mode": self.mode} if self.mode != "store" else {}
            # Re-sort by measured uplink between versions only: a reshuffle mid-transfer
            # would change parents under running fetches, and two workers fetching one
            # version on two orders can wait on each other (a cycle, until `stall_s`). So
            # once per version: a reply that read an older announcement just before a
            # publish (heartbeats read it without the lock) does not re-sort again; a
            # lower number does only when published since (a learner rerun republishes
            # from its checkpoint).
            v, last = newest_version, self._rebuild_for
            if v > last or (v < last and self._published_since_rebuild):
                self._rebuild_for, self._published_since_rebuild = v, False
                self.topology.rebuild()
            p = self.topology.placement(worker_id)
            urls = [u for u in (p.parent_url, *p.fallback_urls) if u]
            ok = [u for u in urls if self.by_url.get(u) not in self.suspect]
            given = self.routed.setdefault((worker_id, newest_version), [])
            given += [u for u in ok if u not in given][: 8 - len(given)]
            return {
                "broadcast_mode": self.mode,
                "relay_parent": ok[0] if ok else None,
                "relay_fallbacks": ok[1:],
            }

    def fetches(self) -> list[dict]:
        """Every reported fetch of a version still kept: worker_id, version, published_at,
        done_at (controller clock), bytes_from_store, bytes_from_peers."""
        with self.lock:
            return [
                {
                    "worker_id": w,
                    "version": v,
                    "published_at": self.published[v],
                    "done_at": t,
                    "bytes_from_store": self.store_bytes[v].get(w, 0),
                    "bytes_from_peers": self.peer_bytes[v].get(w, 0),
                }
                for v, done in sorted(self.done.items())
                if v in self.published
                for w, t in done.items()
            ]

    def stats(self, now: float) -> dict:
        with self.lock:
            self._prune(now)
            live = set(self.last_seen) & self.reporters
            out = {"broadcast/corrupt_reports": self.corrupt_reports,
                   "broadcast/corrupt_proven": self.proven_corrupt,
                   "broadcast/false_reports": self.false_reports,
                   "broadcast/excluded": len(self.topology.excluded)}  # fmt: skip
            for v in sorted(self.published, reverse=True):
                done = self.done.get(v, {})
                if live and live <= set(done):
                    out["broadcast/latency_s"] = max(done[w] for w in live) - self.published[v]
                    out["broadcast/store_bytes"] = sum(self.store_bytes[v].values())
                    out["broadcast/version"] = v
                    break
            return out
