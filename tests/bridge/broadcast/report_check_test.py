"""A corrupt-chunk report is answered by re-verifying the accused chunk (issue 23 item 2).

Real relays (rollout_gpu/relay.py) on loopback hold version 1, fetched from a file store;
one of them is hostile and flips a byte of every chunk it serves. Five workers heartbeat
the real controller service over HTTP (relay URLs, fetch reports), in chain order
h1 <- h2 <- liar <- hostile <- child, so the child is routed to the hostile relay (its
parent) and the liar to h2 and h1. Asserted: a report that names no chunk counts for
nothing; the child's one report that names a chunk gets the hostile relay excluded at once
(the controller fetched the chunk from it and the digest in the store's manifest failed;
no second reporter needed); the liar's reports against honest relays (a chunk they serve
intact, a key that is no chunk of the version) are withdrawn, exclude no one, and cost the
liar: after `bad_limit` falsely accused relays it relays no more and is not listened to.
"""

import time

import httpx
import numpy as np
import pytest

from bridge.broadcast import chunks as chunks_lib
from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.http.service import ServerOptions, load_or_create_join_secret, serve_controller
from bridge.store.weight_store import WeightStore
from bridge.tasks import make_task
from rollout_gpu.relay import Relay

VERSION = 1
PROFILE = {"accelerator": "cpu", "price_per_hour": 0.0, "max_concurrent_sequences": 8}


def flip(key, body):
    return bytes([body[0] ^ 0xFF]) + body[1:] if "/c/" in key and body else body


@pytest.fixture
def fleet(tmp_path):
    store = WeightStore(str(tmp_path / "store"))
    rng = np.random.default_rng(0)
    arrays = [("a", rng.standard_normal((64, 32)).astype(np.float32)),
              ("b", rng.standard_normal((300,)).astype(np.float32))]  # fmt: skip
    store.publish(VERSION, 1, arrays, {}, dtype="float32")
    relays = {name: Relay(tamper=flip if name == "hostile" else None)
              for name in ("h1", "h2", "hostile")}  # fmt: skip
    ctl = Controller(
        ControllerConfig(broadcast="chain", broadcast_bad_limit=2),
        str(tmp_path / "c.db"),
        make_task("arithmetic"),
    )
    server = serve_controller(ctl, str(tmp_path), ServerOptions(host="127.0.0.1", port=0))
    try:
        for r in relays.values():
            r.start()
            r.fetch(VERSION, [store.spec], timeout=60)
        ctl.publish(VERSION, store=store.spec)
        yield ctl, server, store, relays, load_or_create_join_secret(str(tmp_path))
    finally:
        for r in relays.values():
            r.stop()
        server.stop()
        ctl.close()


class Worker:
    def __init__(self, client, secret, relay_url):
        r = client.post("/v1/register", json={"join_secret": secret, "profile": PROFILE})
        self.id, self.client, self.relay_url = r.json()["worker_id"], client, relay_url
        self.headers = {"Authorization": f"Bearer {r.json()['token']}"}

    def heartbeat(self, bad=()):
        report = {"version": VERSION, "fetched_ago_s": 0.0, "fetch_s": 1.0,
                  "bad_sources": [dict(source=s, kind="corrupt", **k) for s, k in bad]}  # fmt: skip
        body = {"worker_version": VERSION, "relay_url": self.relay_url, "broadcast": report}
        r = self.client.post("/v1/heartbeat", headers=self.headers, json=body)
        assert r.status_code == 200, r.text
        return r.json()


def wait_for(ctl, what, deadline_s=60.0):
    """Poll the broadcast state until `what(stats)` (the check runs off the heartbeat)."""
    end = time.monotonic() + deadline_s
    while True:
        stats = ctl.broadcast.stats(ctl.clock())
        if what(stats):
            return stats
        assert time.monotonic() < end, stats
        time.sleep(0.05)


def test_corrupt_reports_are_checked_against_the_digest(fleet):
    ctl, server, store, relays, secret = fleet
    key = chunks_lib.chunk_plan(VERSION, store.manifest(VERSION))[0].key
    unused = "http://127.0.0.1:9"  # the liar's and child's relays are never asked
    with httpx.Client(base_url=server.url, timeout=30) as client:
        w = {name: Worker(client, secret, relays[name].url) for name in ("h1", "h2")}
        w["liar"] = Worker(client, secret, unused + "1")
        w["hostile"] = Worker(client, secret, relays["hostile"].url)
        w["child"] = Worker(client, secret, unused + "2")
        routes = {name: wk.heartbeat() for name, wk in w.items()}  # join in chain order
        url = {name: wk.relay_url for name, wk in w.items()}
        assert routes["child"]["relay_parent"] == url["hostile"]
        assert routes["liar"]["relay_parent"] == url["h2"]
        assert routes["liar"]["relay_fallbacks"] == [url["h1"]]

        w["child"].heartbeat(bad=[(url["hostile"], {})])  # no chunk named: counts nothing
        assert ctl.broadcast.stats(ctl.clock())["broadcast/corrupt_reports"] == 0
        w["child"].heartbeat(bad=[(url["hostile"], {"key": key})])
        # (the controller's own probe of a newcomer's relay, report_check.probe_uplink, may
        # prove the hostile relay corrupt too, before or after the report)
        wait_for(ctl, lambda s: s["broadcast/corrupt_proven"] >= 1)
        assert ctl.broadcast.topology.excluded == {w["hostile"].id}  # one report: proof
        assert w["child"].heartbeat()["relay_parent"] == url["liar"]

        # The liar accuses its honest parent (a chunk it serves intact) and grandparent (a
        # key that is no chunk of the version): both withdrawn, both held against it.
        w["liar"].heartbeat(bad=[(url["h2"], {"key": key})])
        wait_for(ctl, lambda s: s["broadcast/false_reports"] == 1)
        assert w["liar"].id not in ctl.broadcast.ignored
        w["liar"].heartbeat(bad=[(url["h1"], {"key": f"data/{VERSION}/a/c/9/9"})])
        stats = wait_for(ctl, lambda s: s["broadcast/false_reports"] == 2)
    assert ctl.broadcast.topology.excluded == {w["hostile"].id, w["liar"].id}
    assert ctl.broadcast.ignored == {w["liar"].id}
    assert ctl.broadcast.topology.order[:2] == [w["h1"].id, w["h2"].id]  # still relaying
    assert stats["broadcast/corrupt_reports"] == 3 and stats["broadcast/corrupt_proven"] in (1, 2)
