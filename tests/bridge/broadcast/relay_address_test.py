"""A remote worker's default loopback relay URL becomes the address it called from."""

import pytest
from fastapi.testclient import TestClient

from bridge.broadcast.relay_address import reachable_relay_url


@pytest.mark.parametrize(
    "claimed, caller, want",
    [
        ("http://127.0.0.1:8123", "203.0.113.7", "http://203.0.113.7:8123"),
        ("http://localhost:8123/", "203.0.113.7", "http://203.0.113.7:8123/"),
        ("http://[::1]:8123", "2001:db8::5", "http://[2001:db8::5]:8123"),
        ("http://127.0.0.1:8123", "127.0.0.1", "http://127.0.0.1:8123"),  # same machine
        ("http://relay.example.org:9", "203.0.113.7", "http://relay.example.org:9"),  # explicit
        ("http://10.0.0.4:9", "203.0.113.7", "http://10.0.0.4:9"),  # a private LAN name
        ("", "203.0.113.7", ""),  # no relay
        ("http://127.0.0.1:8123", None, "http://127.0.0.1:8123"),
    ],
)
def test_reachable_relay_url(claimed, caller, want):
    assert reachable_relay_url(claimed, caller) == want


def test_the_service_routes_children_to_the_callers_address(tmp_path):
    from bridge.contracts.prompt import TextCodec
    from bridge.control.config import ControllerConfig
    from bridge.control.controller import Controller
    from bridge.control.protocol import SamplingParams
    from bridge.control.service import make_app
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
    app = make_app(ctl, join_secret="s3cret")
    ctl.publish(0)
    ids = []
    for ip in ("198.51.100.1", "198.51.100.2"):  # two remote workers, default relay URLs
        client = TestClient(app, client=(ip, 40000))
        reg = client.post(
            "/v1/register",
            json={
                "join_secret": "s3cret",
                "profile": {
                    "accelerator": "cpu",
                    "price_per_hour": 0.1,
                    "max_concurrent_sequences": 4,
                },
            },
        )
        token = reg.json()["token"]
        ids.append((client, {"Authorization": f"Bearer {token}"}))
    hb = {"worker_version": -1, "relay_url": "http://127.0.0.1:7001", "up_bytes_per_s": 1e6}
    for client, auth in ids:
        assert client.post("/v1/heartbeat", json=hb, headers=auth).status_code == 200
    both = [c.post("/v1/heartbeat", json=hb, headers=a).json() for c, a in ids]
    routes = [u for r in both for u in [r.get("relay_parent"), *r.get("relay_fallbacks", [])]]
    # One worker is the chain's root (fed by the store), the other its child: the child is
    # sent to the root's address as seen by the controller, never to a loopback URL.
    assert [u for u in routes if u] in (["http://198.51.100.1:7001"], ["http://198.51.100.2:7001"])
    ctl.close()
