"""Topology from measured delivery only, through the controller's HTTP API (uvicorn on
loopback, heartbeats as workers send them): a worker's declared uplink places no one (a
newcomer declaring 10 TB/s is neither the chain's root nor anyone's parent), a newcomer is a
leaf until the controller has measured its relay (real relays on loopback: one serving
nothing stays a leaf, one serving altered bytes is excluded, an honest one relays), and a
Sybil child's claim about its parent cannot keep a relay that serves nothing at the tree's
root."""

import os
import time

import httpx
import numpy as np
import pytest

from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.http.service import ServerOptions, load_or_create_join_secret, serve_controller
from bridge.control.protocol import SamplingParams
from bridge.store.weight_store import WeightStore
from bridge.tasks import make_task
from rollout_gpu.relay import Relay

PROFILE = {"accelerator": "cpu", "price_per_hour": 0.0, "max_concurrent_sequences": 4}
STORE = "s3://bucket/run"


class Fleet:
    """Workers registered over HTTP; `beat` sends one heartbeat and returns its route."""

    def __init__(self, ctl, url, secret):
        self.ctl, self.client, self.secret = ctl, httpx.Client(base_url=url, timeout=10), secret
        self.auth, self.relay, self.ids = {}, {}, {}

    def join(self, name: str, up: float, url: str = "") -> None:
        r = self.client.post("/v1/register", json={"join_secret": self.secret, "profile": PROFILE})
        assert r.status_code == 200, r.text
        self.auth[name] = {"Authorization": f"Bearer {r.json()['token']}"}
        self.ids[name] = r.json()["worker_id"]
        self.relay[name] = (url or f"http://127.0.0.1:{10000 + len(self.relay)}", up)

    def beat(self, name: str, report: dict | None = None) -> dict:
        url, up = self.relay[name]
        body = {"worker_version": -1, "relay_url": url, "up_bytes_per_s": up}
        if report is not None:
            body["broadcast"] = report
        r = self.client.post("/v1/heartbeat", json=body, headers=self.auth[name])
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture
def fleet_of(tmp_path):
    made = []

    def start(mode: str) -> Fleet:
        ctl = Controller(
            ControllerConfig(staleness=1, groups_per_step=1, group_size=2, vocab_size=100,
                             sampling=SamplingParams(max_tokens=4), broadcast=mode),
            os.path.join(tmp_path, "c.db"), make_task("arithmetic"),
        )  # fmt: skip
        server = serve_controller(ctl, str(tmp_path), ServerOptions())
        fleet = Fleet(ctl, server.url, load_or_create_join_secret(str(tmp_path)))
        made.append((server, ctl, fleet))
        return fleet

    yield start
    for server, ctl, fleet in made:
        fleet.client.close()
        server.stop()
        ctl.close()


def test_a_declared_uplink_makes_no_one_root_or_parent(fleet_of):
    fleet = fleet_of("chain")
    fleet.ctl.publish(1, STORE)
    for name in ("h1", "h2"):
        fleet.join(name, up=5e6)
        fleet.beat(name)
    fleet.join("liar", up=1e13)  # declares 10 TB/s, before anything is measured
    liar_url = fleet.relay["liar"][0]
    for v in (2, 3):  # each new version re-ranks the chain
        fleet.ctl.publish(v, STORE)
        routes = {name: fleet.beat(name) for name in ("h1", "h2", "liar")}
        assert routes["liar"]["relay_parent"] is not None, v  # not the root
        for name in ("h1", "h2"):  # nobody's parent, nor anyone's fallback
            assert liar_url not in (routes[name]["relay_parent"], *routes[name]["relay_fallbacks"])


def test_a_sybil_child_cannot_keep_a_relay_that_serves_nothing_at_the_root(fleet_of):
    """The attacker's relay joined first (so it is the root until measured) and serves
    nothing; its Sybil child reports receiving 8 MB from it in 8 us (1e12 B/s) for every
    version; the honest workers report what they really got."""
    fleet = fleet_of("tree")
    fleet.ctl.publish(1, STORE)
    names = ("attacker", "sybil", "h1", "h2", "h3", "h4")
    for name in names:
        fleet.join(name, up=1e13 if name in ("attacker", "sybil") else 5e6)
    serves_nothing = {fleet.relay[n][0] for n in ("attacker", "sybil")}
    roots = []
    for v in range(1, 6):
        fleet.ctl.publish(v, STORE)
        parents = {name: fleet.beat(name)["relay_parent"] for name in names}
        roots.append([n for n in names if parents[n] is None])
        for name in names:
            if name == "sybil":
                got = {"bytes_from_peers": 8_000_000, "fetch_s": 8e-6}
            elif parents[name] in serves_nothing:
                got = {"bytes_from_store": 8_000_000, "fetch_s": 4.0}  # fell back to the store
            else:
                got = {"bytes_from_peers": 8_000_000, "fetch_s": 2.0}
            fleet.beat(name, {"version": v, "fetched_ago_s": 0.0, **got})
    assert roots[0] == ["attacker"]  # nothing measured yet: join order
    assert all(r and r[0] not in ("attacker", "sybil") for r in roots[1:]), roots


def flip(key: str, body: bytes) -> bytes:
    return bytes([body[0] ^ 0xFF]) + body[1:] if body and not key.endswith(".json") else body


def test_a_newcomer_is_a_leaf_until_the_controller_has_measured_its_relay(tmp_path, fleet_of):
    store = WeightStore(str(tmp_path / "store"))
    for v in (1, 2, 3):
        a = np.random.default_rng(v).standard_normal((256, 256)).astype(np.float32)
        store.publish(v, v, [("a", a)], {})
    relays = {n: Relay(tamper=flip if n == "tamperer" else None)
              for n in ("h1", "h2", "h3", "tamperer")}  # fmt: skip
    fleet = fleet_of("chain")
    topology = fleet.ctl.broadcast.topology  # read only to wait for the probes' answers
    measured = lambda n: topology.nodes[fleet.ids[n]].delivered_bytes_per_s  # noqa: E731

    def wait_for(cond):
        deadline = time.monotonic() + 30
        while not cond():
            assert time.monotonic() < deadline
            time.sleep(0.05)

    def holds(names, v):
        for n in names:
            relays[n].fetch(v, [store.spec], timeout=30)
            fleet.beat(n, {"version": v, "fetched_ago_s": 0.0, "fetch_s": 2.0,
                           "bytes_from_peers": 8_000_000})  # fmt: skip

    try:
        for r in relays.values():
            r.start()
        fleet.ctl.publish(1, store.spec)
        for n in ("h1", "h2"):  # the first version: the fleet relays in join order
            fleet.join(n, up=5e6, url=relays[n].url)
            fleet.beat(n)
        holds(["h1", "h2"], 1)  # each reports holding version 1: the controller probes it
        wait_for(lambda: measured("h1") and measured("h2"))
        fleet.join("liar", up=1e13)  # declares 10 TB/s; its relay answers nothing
        for n in ("h3", "tamperer"):
            fleet.join(n, up=1e13, url=relays[n].url)
        newcomers = {n: fleet.relay[n][0] for n in ("liar", "h3", "tamperer")}
        fleet.ctl.publish(2, store.spec)
        routes = {n: fleet.beat(n) for n in fleet.relay}
        for n, url in newcomers.items():  # leaves: under a measured relay, above no one
            assert routes[n]["relay_parent"] is not None, n
            assert all(url not in (r["relay_parent"], *r["relay_fallbacks"])
                       for r in routes.values()), n  # fmt: skip
        holds(["h1", "h2", "h3", "tamperer"], 2)
        fleet.beat("liar", {"version": 2, "fetched_ago_s": 0.0, "fetch_s": 1.0})
        wait_for(lambda: measured("h3") and fleet.ids["tamperer"] in topology.excluded)
        fleet.ctl.publish(3, store.spec)
        routes = {n: fleet.beat(n) for n in fleet.relay}
        parents = {r["relay_parent"] for r in routes.values()}
        # Measured: it relays now (a link of the chain, or the end of it: the two leaves
        # hang where the uplink per child is largest, not necessarily under it).
        assert fleet.ids["h3"] in topology.relaying
        assert newcomers["h3"] in parents or fleet.ids["h3"] == topology.order[2]
        assert not parents & {newcomers["liar"], newcomers["tamperer"]}
        assert routes["liar"]["relay_parent"] is not None
    finally:
        for r in relays.values():
            r.stop()
