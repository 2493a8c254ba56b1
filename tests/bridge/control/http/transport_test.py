"""Transport and logs (issue 23 item 12): plain HTTP from a non-loopback address is refused
unless `controller.allow_plain_http` (the announced store could be rewritten on the way),
the training binary's config names the certificate (`controller.tls_cert`,
`controller.tls_key`; tls_test.py shows the controller serving it), and worker-supplied
strings cannot forge a log line."""

import logging
import os

import pytest
from fastapi.testclient import TestClient

from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.http.service import make_app
from bridge.control.protocol import SamplingParams
from bridge.tasks import make_task

PROFILE = {"accelerator": "cpu", "price_per_hour": 0.0, "max_concurrent_sequences": 4}
REMOTE = ("203.0.113.9", 40000)


@pytest.fixture
def ctl(tmp_path, text_codec):
    c = Controller(
        ControllerConfig(staleness=1, groups_per_step=1, group_size=2, vocab_size=100,
                         sampling=SamplingParams(max_tokens=4)),
        os.path.join(tmp_path, "c.db"), make_task("arithmetic"), codec=text_codec,
    )  # fmt: skip
    c.publish(0, "s3://bucket/run")  # a remote store: the URL a path attacker would rewrite
    yield c
    c.close()


def register(client):
    return client.post("/v1/register", json={"join_secret": "s3cret", "profile": PROFILE})


def test_plain_http_to_a_remote_worker_is_refused_unless_allowed(ctl):
    app = make_app(ctl, "s3cret")
    remote = TestClient(app, client=REMOTE)
    for path in ("/v1/register", "/v1/heartbeat", "/v1/lease", "/v1/version"):
        r = remote.post(path, json={}) if path != "/v1/version" else remote.get(path)
        assert r.status_code == 403 and "controller.tls_cert" in r.text, (path, r.text)
    assert ctl.worker_versions() == []  # nothing registered, nothing announced
    assert remote.get("/openapi.json").status_code == 200
    # The same controller over TLS (the scheme uvicorn reports with a certificate), from the
    # same machine, or with the operator's explicit opt-in: served.
    assert register(TestClient(app, client=REMOTE, base_url="https://testserver")).is_success
    assert register(TestClient(app, client=("127.0.0.1", 40000))).is_success
    opted_in = TestClient(make_app(ctl, "s3cret", allow_plain_http=True), client=REMOTE)
    r = register(opted_in)
    assert r.is_success and r.json()["announcement"]["store"] == "s3://bucket/run"


def test_the_training_config_names_the_certificate():
    from configs.tiny_arith import get_config
    from learner_jax import run_config

    c = get_config()
    assert (c.controller.tls_cert, c.controller.tls_key, c.controller.allow_plain_http) == (
        "",
        "",
        False,
    )
    plain = run_config.server_options(c)
    assert plain.certfile is None and plain.keyfile is None and not plain.allow_plain_http
    c.controller.tls_cert, c.controller.tls_key = "/certs/c.pem", "/certs/k.pem"
    c.controller.allow_plain_http = True
    c.controller.relay_hosts = "nat.example.org, 198.51.100.7"
    o = run_config.server_options(c)
    assert (o.certfile, o.keyfile, o.allow_plain_http) == ("/certs/c.pem", "/certs/k.pem", True)
    assert o.relay_hosts == ("nat.example.org", "198.51.100.7")


def test_worker_strings_cannot_forge_a_log_line(ctl, caplog):
    client = TestClient(make_app(ctl, "s3cret"), client=("127.0.0.1", 40000))
    forged = "fine\nWARNING root: worker w-0 quarantined\r\x1b[2J\u2028x"
    reg = client.post(
        "/v1/register",
        json={"join_secret": "s3cret", "profile": {**PROFILE, "name": forged[:100]}},
    )
    auth = {"Authorization": f"Bearer {reg.json()['token']}"}
    lease = client.post("/v1/lease", json={"worker_version": 0}, headers=auth).json()["lease"]
    with caplog.at_level(logging.INFO):
        r = client.post(
            "/v1/release", json={"lease_id": lease["lease_id"], "reason": forged}, headers=auth
        )
        assert r.json()["ok"]
        r = client.post("/v1/release", json={"lease_id": "x\nforged", "reason": "r"}, headers=auth)
        assert r.status_code == 404
        hb = {"worker_version": 0, "relay_url": "file:///etc/passwd\nWARNING forged"}
        assert client.post("/v1/heartbeat", json=hb, headers=auth).is_success
    messages = [rec.getMessage() for rec in caplog.records]
    assert any("quarantined" in m for m in messages)  # the reason was logged, escaped
    assert any("relay URL" in m for m in messages)
    for m in messages:
        assert not any(ch in m for ch in "\n\r\x1b\u2028"), m
    status = client.get("/v1/status", headers=auth).json()
    names = [w.get("name", "") for w in status.get("workers", [])]
    assert len(names) == 1 and "\\n" in names[0] and "\n" not in names[0], names
