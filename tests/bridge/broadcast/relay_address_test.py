"""Advertised relay URLs are not a way in (issue 23 item 4): a worker may only point its
peers at the address it called from (or an allow-listed host), over http(s), so no URL it
advertises can send the fleet to a file, an object store or the controller's network."""

import pytest
from fastapi.testclient import TestClient

from bridge.broadcast.relay_address import advertised_relay_url, reachable_relay_url

PROFILE = {"accelerator": "cpu", "price_per_hour": 0.1, "max_concurrent_sequences": 4}


@pytest.mark.parametrize(
    "claimed, caller, want",
    [
        ("http://127.0.0.1:8123", "203.0.113.7", "http://203.0.113.7:8123"),
        ("http://localhost:8123/", "203.0.113.7", "http://203.0.113.7:8123"),
        ("http://[::1]:8123", "2001:db8::5", "http://[2001:db8::5]:8123"),
        ("http://127.0.0.1:8123", "127.0.0.1", "http://127.0.0.1:8123"),  # same machine
        ("https://203.0.113.7:8123", "203.0.113.7", "https://203.0.113.7:8123"),
        # Another host is never taken: peers are sent to the caller's address instead.
        ("http://relay.example.org:9", "203.0.113.7", "http://203.0.113.7:9"),
        ("http://10.0.0.4:9", "203.0.113.7", "http://203.0.113.7:9"),  # controller's LAN
        ("http://169.254.169.254", "203.0.113.7", "http://203.0.113.7"),  # metadata service
        ("file:///etc/passwd", "203.0.113.7", ""),
        ("s3://bucket/run/weights", "203.0.113.7", ""),
        ("gs://bucket/run", "203.0.113.7", ""),
        ("memory://relay", "127.0.0.1", ""),
        ("/tmp/store", "127.0.0.1", ""),
        ("http://user:pw@203.0.113.7:9", "203.0.113.7", ""),
        ("http://203.0.113.7:9/kv/../x", "203.0.113.7", ""),
        ("http://203.0.113.7:99999", "203.0.113.7", ""),
        ("", "203.0.113.7", ""),  # no relay
        ("http://127.0.0.1:8123", None, "http://127.0.0.1:8123"),  # caller unknown: loopback only
        ("http://10.0.0.4:9", None, ""),
    ],
)
def test_advertised_relay_url(claimed, caller, want):
    assert reachable_relay_url(claimed, caller) == want


def test_an_allow_listed_host_is_kept():
    allow = ["relay.example.org"]
    got = advertised_relay_url("http://Relay.Example.org:9", "203.0.113.7", allow)
    assert got == ("http://relay.example.org:9", "")
    assert advertised_relay_url("http://10.0.0.4:9", "203.0.113.7", allow)[1]  # replaced
    assert reachable_relay_url("file://relay.example.org/x", "203.0.113.7", allow) == ""


@pytest.fixture
def controller(tmp_path):
    from bridge.contracts.prompt import TextCodec
    from bridge.control.config import ControllerConfig
    from bridge.control.controller import Controller
    from bridge.control.protocol import SamplingParams
    from bridge.model import tiny_model
    from bridge.tasks import make_task

    tok = tmp_path / "tok"
    tok.mkdir()
    tiny_model.save_tokenizer(str(tok))
    ctl = Controller(
        ControllerConfig(staleness=1, groups_per_step=1, group_size=2, vocab_size=100,
                         sampling=SamplingParams(max_tokens=4), broadcast="chain"),
        str(tmp_path / "c.db"), make_task("arithmetic"), codec=TextCodec(str(tok)),
    )  # fmt: skip
    ctl.publish(0)
    yield ctl
    ctl.close()


def _worker(app, ip):
    client = TestClient(app, client=(ip, 40000))
    reg = client.post("/v1/register", json={"join_secret": "s3cret", "profile": PROFILE})
    return client, {"Authorization": f"Bearer {reg.json()['token']}"}


HOSTILE = [
    "file:///etc/passwd",
    "s3://victim-bucket/runs/r1",
    "gs://victim-bucket/runs/r1",
    "s3://victim-bucket",  # a bare bucket: the scheme alone must refuse it
    "file://198.51.100.1",  # the caller's own address, but not over http(s)
    "http://10.0.0.4:8080",  # a service on the controller's network
    "http://169.254.169.254",  # the cloud metadata service
    "http://user:pw@198.51.100.1:7001",
    "http://198.51.100.1:7001/../store",
]


def test_no_advertised_url_reaches_a_peer_but_the_callers_own_address(controller):
    from bridge.control.http.service import make_app

    app = make_app(controller, join_secret="s3cret", allow_plain_http=True)
    hostile, hostile_auth = _worker(app, "198.51.100.1")
    honest, honest_auth = _worker(app, "198.51.100.2")
    honest_hb = {
        "worker_version": -1,
        "relay_url": "http://198.51.100.2:7002",
        "up_bytes_per_s": 1e6,
    }
    handed = []
    for version, url in enumerate(HOSTILE, start=1):
        controller.publish(version)  # the chain is re-sorted for each new version
        # The hostile worker claims the fastest uplink, so it would be the chain's root.
        hb = {"worker_version": -1, "relay_url": url, "up_bytes_per_s": 1e12}
        for client, auth, body in ((hostile, hostile_auth, hb), (honest, honest_auth, honest_hb)):
            for _ in range(2):  # the second sees the first's placement
                r = client.post("/v1/heartbeat", json=body, headers=auth)
                assert r.status_code == 200, r.text
                handed += [r.json().get("relay_parent"), *r.json().get("relay_fallbacks", [])]
                r = client.post("/v1/lease", json={"worker_version": version}, headers=auth)
                handed += [r.json().get("relay_parent"), *r.json().get("relay_fallbacks", [])]
        stored = {n.relay_url for n in controller.broadcast.topology.nodes.values()}
        assert stored <= {"", "http://198.51.100.2:7002", "http://198.51.100.1:8080",
                          "http://198.51.100.1"}, (url, stored)  # fmt: skip
    handed = {u for u in handed if u}
    # Peers were told of relays (the test is not vacuous) and only ever of the callers' own
    # addresses: "http://10.0.0.4:8080" became the hostile worker's own address.
    assert handed and handed <= {"http://198.51.100.2:7002", "http://198.51.100.1:8080",
                                 "http://198.51.100.1"}, handed  # fmt: skip
    assert not any(h in u for u in handed for h in ("10.0.0.4", "169.254", "s3:", "file:"))


def test_the_service_routes_children_to_the_callers_address(controller):
    from bridge.control.http.service import make_app

    app = make_app(controller, join_secret="s3cret", allow_plain_http=True)
    ids = [_worker(app, ip) for ip in ("198.51.100.1", "198.51.100.2")]
    hb = {"worker_version": -1, "relay_url": "http://127.0.0.1:7001", "up_bytes_per_s": 1e6}
    for client, auth in ids:
        assert client.post("/v1/heartbeat", json=hb, headers=auth).status_code == 200
    both = [c.post("/v1/heartbeat", json=hb, headers=a).json() for c, a in ids]
    routes = [u for r in both for u in [r.get("relay_parent"), *r.get("relay_fallbacks", [])]]
    # One worker is the chain's root (fed by the store), the other its child: the child is
    # sent to the root's address as seen by the controller, never to a loopback URL.
    assert [u for u in routes if u] in (["http://198.51.100.1:7001"], ["http://198.51.100.2:7001"])
