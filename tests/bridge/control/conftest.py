"""Fixtures of the controller tests: the run's tokenizer the controller encodes prompts and
decodes completions with (the tiny character-level one, no model weights needed), and a
controller served over real HTTP (uvicorn on loopback, port 0) with an httpx client."""

import os

import httpx
import pytest

from bridge.contracts.prompt import TextCodec
from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.http.service import ServerOptions, load_or_create_join_secret, serve_controller
from bridge.control.protocol import SamplingParams
from bridge.model import tiny_model
from bridge.tasks import make_task


@pytest.fixture(scope="session")
def text_codec(tmp_path_factory) -> TextCodec:
    path = tmp_path_factory.mktemp("tokenizer")
    tiny_model.save_tokenizer(str(path))
    return TextCodec(str(path))


@pytest.fixture
def service(tmp_path, text_codec):
    workdir = str(tmp_path)
    ctl = Controller(
        ControllerConfig(
            staleness=1,
            groups_per_step=2,
            group_size=2,
            vocab_size=100,
            sampling=SamplingParams(max_tokens=4),
        ),
        os.path.join(workdir, "controller.db"),
        make_task("arithmetic", format_reward=0.1),
        codec=text_codec,
    )
    server = serve_controller(ctl, workdir, ServerOptions(max_body_bytes=64 * 1024))
    secret = load_or_create_join_secret(workdir)
    with httpx.Client(base_url=server.url, timeout=10) as client:
        yield ctl, server, client, secret, workdir
    server.stop()
    ctl.close()
