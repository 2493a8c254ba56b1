"""A hostile peer for the chaos soak (issue 23, class 1): a relay that serves altered chunks.

With fault `hostile_peer` the soak's broadcast runs as a relay chain
(`bridge.broadcast=chain`, even on the local store) and the honest workers run their relays,
so they fetch chunks from peers. `HostilePeer` joins with the run's join secret like a
worker, runs a real relay (rollout_gpu/relay.py) on `host` (127.0.0.1; in a testbed the root
namespace's address on the testbed's bridge, so the workers' namespaces reach it: the
controller hands peers the address the heartbeat came from) whose `tamper` hook flips the
first byte of every chunk it serves, fetches each announced version from the store into
it, and heartbeats its relay URL with a huge declared uplink (which places it nowhere: the
controller ranks by measured delivery; joining after the fleet's first version it is a leaf
until the controller's own probe of its relay, which gets an altered chunk and excludes it;
before that, in join order, its children catch it). With `liar`
it also reports its own routed parent, an honest relay, as having served a corrupt chunk (a
real chunk key of the version): the controller re-verifies and must hold that against the
liar, not the relay. It takes no leases: its only weapon is bytes.

`verdict` is the soak's check: the peer served altered chunks (the attack was tried), the
controller proved one and excluded the peer (`broadcast/corrupt_proven`), no honest relay
was excluded (`broadcast/excluded` never above the one hostile peer), and no honest worker
failed a canary after a load (the only way a poisoned chunk that passed the digest would
show) while they kept swapping versions.
"""

from __future__ import annotations

import threading
import time

from bench.chaos_faults import _post
from bridge.broadcast import chunks as chunks_lib
from bridge.store.weight_store import WeightStore
from rollout_gpu.relay import Relay

DECLARED_UP = 1e12  # bytes/s: a lie (only a cap on what its children measure)


def flip(key: str, body: bytes | None) -> bytes | None:
    """The altered bytes: every chunk (not the zarr.json metadata) with its first byte flipped."""
    if not body or key.endswith(".json"):
        return body
    return bytes([body[0] ^ 0xFF]) + body[1:]


class HostilePeer(threading.Thread):
    def __init__(self, url: str, secret: str, liar: bool = True, period_s: float = 1.0,
                 host: str = "127.0.0.1"):  # fmt: skip
        super().__init__(daemon=True, name="hostile-peer")
        self.url, self.secret, self.liar, self.period_s = url, secret, liar, period_s
        self.stop_event = threading.Event()
        self.token, self.store, self.held, self.parent = None, None, -1, None
        self.accused: set[tuple[str, int]] = set()
        self.relay = Relay(host=host, tamper=self._tamper)
        self.result = {"class": "corrupting_relay", "worker_ids": [], "relay_url": "",
                       "versions_held": 0, "tampered_chunks": 0, "tamper_times": [],
                       "false_reports": 0, "heartbeats": 0, "errors": 0,
                       "last_error": ""}  # fmt: skip

    def _tamper(self, key: str, body: bytes) -> bytes:
        out = flip(key, body)
        if out != body:
            self.result["tampered_chunks"] += 1
            self.result["tamper_times"].append(time.time())
        return out

    def stop(self) -> dict:
        self.stop_event.set()
        self.join(timeout=60)
        self.relay.stop()
        r = dict(self.result)
        times = r.pop("tamper_times")
        r["tampering_s"] = round(times[-1] - times[0], 1) if times else None
        return r

    def run(self) -> None:
        self.result["relay_url"] = self.relay.start()
        while not self.stop_event.is_set():
            try:
                if self.token is None:
                    self._register()
                self._heartbeat()
            except Exception as e:  # noqa: BLE001 - the binary may be down (killed): retry
                self.result["errors"] += 1
                self.result["last_error"] = f"{type(e).__name__}: {e}"[:200]
            self.stop_event.wait(self.period_s)

    def _register(self) -> None:
        profile = {"accelerator": "cpu", "price_per_hour": 0.0, "max_concurrent_sequences": 4}
        code, r = _post(self.url, "/v1/register", {"join_secret": self.secret, "profile": profile})
        if code != 200:
            raise RuntimeError(f"register: {code}")
        self.token = r["token"]
        self.result["worker_ids"].append(r["worker_id"])

    def _heartbeat(self) -> None:
        body = {"worker_version": max(self.held, -1), "relay_url": self.relay.url,
                "up_bytes_per_s": DECLARED_UP}  # fmt: skip
        report = self._false_report()
        if report:
            body["broadcast"] = report
        code, r = _post(self.url, "/v1/heartbeat", body, self.token)
        if code == 401:  # a new controller database (the binary reran): join again
            self.token = None
            return
        if code != 200:
            raise RuntimeError(f"heartbeat: {code}")
        self.result["heartbeats"] += 1
        self.parent = r.get("relay_parent")
        ann = r["announcement"]
        self.store = ann.get("store") or self.store
        if ann["version"] > self.held and self.store:
            self.relay.fetch(ann["version"], [self.store], timeout=120)  # from the store: honest
            self.held = ann["version"]
            self.result["versions_held"] += 1

    def _false_report(self) -> dict | None:
        """Accuse the parent this controller routed us to of a corrupt (in truth intact)
        chunk of the version we hold: once per (parent, version)."""
        parent = self.parent
        if not self.liar or not parent or self.held < 0 or (parent, self.held) in self.accused:
            return None
        self.accused.add((parent, self.held))
        key = chunks_lib.chunk_plan(self.held, WeightStore(self.store).manifest(self.held))[0].key
        self.result["false_reports"] += 1
        return {"version": self.held, "fetched_ago_s": 0.0, "fetch_s": 1.0,
                "bad_sources": [{"source": parent, "kind": "corrupt", "key": key}]}  # fmt: skip


def start(url: str, secret: str, liar: bool = True, host: str = "127.0.0.1") -> HostilePeer:
    peer = HostilePeer(url, secret, liar, host=host)
    peer.start()
    return peer


def canary_failures(log_lines) -> list[str]:
    """Honest worker log lines where a load passed every digest but failed the canary."""
    return [x for x in log_lines if "could not load version" in x and "Canary" in x]


def exclusions(rows: list[dict]) -> list[dict]:
    """Per binary run (the broadcast counters restart at 0): seconds and learner steps from
    the run's first logged step to the first step the peer was out of the chain, and why."""
    runs, out = [], []
    for r in rows:
        if not runs or r["broadcast/corrupt_reports"] < runs[-1][-1]["broadcast/corrupt_reports"]:
            runs.append([])
        runs[-1].append(r)
    for run in runs:
        hit = next((r for r in run if r["broadcast/excluded"]), None)
        out.append({
            "first_step": run[0]["step"],
            "excluded_after_steps": hit["step"] - run[0]["step"] if hit else None,
            "excluded_after_s": round(hit["time/wall"] - run[0]["time/wall"], 1) if hit else None,
            "by": None if not hit else "proof" if hit["broadcast/corrupt_proven"] else "lies",
        })  # fmt: skip
    return out


def verdict(peer: dict, metrics_rows: list[dict], worker_log_lines: list[str]) -> dict:
    """The soak's class-1 check (module docstring)."""
    rows = [r for r in metrics_rows if "broadcast/excluded" in r]  # the controller's stats
    proven = max((r["broadcast/corrupt_proven"] for r in rows), default=0)
    excluded = max((r["broadcast/excluded"] for r in rows), default=0)
    # Counts are per binary run (broadcast state is in memory). Only the hostile peer may be
    # excluded, and only once the controller proved a chunk of it corrupt or caught it lying
    # (`bad_limit` = 2 false reports): any other exclusion is an honest relay's.
    honest_excluded = [
        r["step"]
        for r in rows
        if r["broadcast/excluded"]
        > (1 if r["broadcast/corrupt_proven"] or r["broadcast/false_reports"] >= 2 else 0)
    ]
    reports = max((r.get("broadcast/corrupt_reports", 0) for r in metrics_rows), default=0)
    false = max((r.get("broadcast/false_reports", 0) for r in metrics_rows), default=0)
    poisoned = canary_failures(worker_log_lines)
    swaps = sum("now serving version" in x for x in worker_log_lines)
    return {
        "ok": peer["tampered_chunks"] > 0
        and proven >= 1
        and not honest_excluded
        and not poisoned
        and swaps > 0,
        "tampered_chunks_served": peer["tampered_chunks"],
        "tampering_s": peer.get("tampering_s"),
        "corrupt_reports": reports,
        "corrupt_proven": proven,
        "excluded_max": excluded,
        "honest_excluded_at_steps": honest_excluded[:5],
        "false_reports_sent": peer.get("false_reports", 0),
        "false_reports_withdrawn": false,
        "exclusions": exclusions(rows),
        "honest_swaps": swaps,
        "poisoned_loads": poisoned[:3],
        "peer": peer,
    }
