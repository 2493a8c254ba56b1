"""Forwarded headers over real HTTP (uvicorn on loopback): X-Forwarded-For / -Proto are
ignored unless `controller.trusted_proxies` names the proxy. uvicorn's own default believes
them from 127.0.0.1, so a worker behind any local forwarder became the address it named and
its peers were routed there (the cloud metadata address below)."""

import os

import httpx
import pytest

from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.http.service import ServerOptions, load_or_create_join_secret, serve_controller
from bridge.control.protocol import SamplingParams
from bridge.tasks import make_task

PROFILE = {"accelerator": "cpu", "price_per_hour": 0.0, "max_concurrent_sequences": 4}
FORGED = {"X-Forwarded-For": "169.254.169.254", "X-Forwarded-Proto": "https"}


@pytest.fixture
def serve(tmp_path, text_codec):
    made = []

    def start(**options):
        workdir = str(tmp_path / f"run{len(made)}")
        os.makedirs(workdir)
        ctl = Controller(
            ControllerConfig(staleness=1, groups_per_step=1, group_size=2, vocab_size=100,
                             sampling=SamplingParams(max_tokens=4), broadcast="chain"),
            os.path.join(workdir, "c.db"), make_task("arithmetic"), codec=text_codec,
        )  # fmt: skip
        ctl.publish(0, "s3://bucket/run")
        server = serve_controller(ctl, workdir, ServerOptions(**options))
        made.append((server, ctl))
        return server.url, load_or_create_join_secret(workdir)

    yield start
    for server, ctl in made:
        server.stop()
        ctl.close()


def parent_of_the_second_worker(url: str, secret: str) -> str | None:
    """The relay the controller routes a second worker to, the first having advertised
    http://127.0.0.1:80 through a forwarder that adds FORGED."""
    with httpx.Client(base_url=url, timeout=10) as c:
        tokens = []
        for headers in (FORGED, {}):
            r = c.post("/v1/register", json={"join_secret": secret, "profile": PROFILE},
                       headers=headers)  # fmt: skip
            assert r.status_code == 200, r.text
            tokens.append({"Authorization": f"Bearer {r.json()['token']}"})
        body = {"worker_version": -1, "relay_url": "http://127.0.0.1:80"}
        assert c.post("/v1/heartbeat", json=body, headers={**tokens[0], **FORGED}).is_success
        r = c.post("/v1/heartbeat", json={**body, "relay_url": "http://127.0.0.1:81"},
                   headers=tokens[1])  # fmt: skip
        return r.json()["relay_parent"]


def test_forwarded_headers_are_ignored_unless_the_proxy_is_trusted(serve):
    assert parent_of_the_second_worker(*serve()) == "http://127.0.0.1:80"
    # The operator's own proxy on loopback, named: its headers are believed.
    url, secret = serve(trusted_proxies=("127.0.0.1",))
    assert parent_of_the_second_worker(url, secret) == "http://169.254.169.254:80"


def test_the_training_config_declares_trusted_proxies():
    from configs.tiny_arith import get_config
    from learner_jax import run_config

    c = get_config()
    assert c.controller.trusted_proxies == ""
    assert run_config.server_options(c).trusted_proxies == ()
    c.controller.trusted_proxies = "10.0.0.5, 192.168.0.0/16"
    assert run_config.server_options(c).trusted_proxies == ("10.0.0.5", "192.168.0.0/16")
