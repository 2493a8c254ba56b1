"""The controller over real HTTP (uvicorn on loopback, port 0) with an httpx client:
auth on every endpoint, join secret, malformed submissions, size limit, schema, TLS (openssl CLI
certificate). The typed client, concurrency and restarts: service_client_test.py."""

import json
import math
import os
import shutil
import ssl
import stat
import subprocess

import httpx
import pytest
from controller_helpers import PROFILE, dump, register

from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.http.service import ControllerServer, ServerOptions, load_or_create_join_secret
from bridge.tasks import make_task


def test_controller_json_join_token_and_schema(service):
    ctl, server, client, secret, workdir = service
    with open(os.path.join(workdir, "controller.json")) as f:
        info = json.load(f)
    assert info["url"] == server.url and server.url.startswith("http://127.0.0.1:")
    assert not server.url.endswith(":0")
    path = os.path.join(workdir, "join_token")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_or_create_join_secret(workdir) == secret  # reused, not regenerated
    schema = client.get("/openapi.json").json()
    assert {
        "/v1/register",
        "/v1/heartbeat",
        "/v1/lease",
        "/v1/submit",
        "/v1/release",
        "/v1/leave",
        "/v1/version",
        "/v1/status",
    } <= set(schema["paths"])
    schemas = schema["components"]["schemas"]
    # What a worker receives has no reference answer; what it sends has no reward.
    assert "answer" not in schemas["PromptGroup"]["properties"]
    assert "prompt_token_ids" in schemas["PromptGroup"]["required"]
    assert "reward" not in schemas["WorkerTrajectory"]["properties"]
    assert "HTTPBearer" in schema["components"]["securitySchemes"]
    assert client.get("/docs").status_code == 401  # no unauthenticated docs pages


def test_every_endpoint_but_registration_needs_a_token(service):
    ctl, server, client, secret, _ = service
    paths = client.get("/openapi.json").json()["paths"]
    checked = 0
    for path, methods in paths.items():
        for method in methods:
            for headers in (
                {},
                {"Authorization": "Bearer not-a-token"},
                {"Authorization": "Basic abc"},
            ):
                r = client.request(method, path, headers=headers, json={})
                if path == "/v1/register":
                    assert r.status_code == 422  # open, but needs a valid body
                else:
                    assert r.status_code == 401, (method, path, r.status_code)
                    assert r.headers["www-authenticate"] == "Bearer"
                checked += 1
    assert checked >= 3 * 8
    assert client.get("/v1/nothing-here").status_code == 401
    # The join secret itself is not a worker token.
    assert (
        client.get("/v1/version", headers={"Authorization": f"Bearer {secret}"}).status_code == 401
    )


def test_join_secret(service, tmp_path):
    ctl, server, client, secret, _ = service
    r = client.post("/v1/register", json={"join_secret": secret + "x", "profile": PROFILE})
    assert r.status_code == 403 and "join secret" in r.json()["detail"]
    r = client.post("/v1/register", json={"join_secret": "", "profile": PROFILE})
    assert r.status_code == 403
    assert ctl.stats()["fleet/active_workers"] == 0
    headers = register(client, secret)
    assert client.get("/v1/version", headers=headers).json()["version"] == -1
    assert client.post("/v1/leave", headers=headers).status_code == 200
    assert client.get("/v1/version", headers=headers).status_code == 401  # token revoked
    token_file = tmp_path / "secret"
    token_file.write_text("s3cret\n")
    assert load_or_create_join_secret(str(tmp_path / "w2"), str(token_file)) == "s3cret"


def _lease(ctl, client, headers):
    ctl.publish(0, {"driver": "memory"})
    r = client.post("/v1/lease", headers=headers, json={"worker_version": 0, "max_groups": 1})
    assert r.status_code == 200, r.text
    return r.json()["lease"]


def _submission(lease, **override):
    group = lease["groups"][0]
    trajs = []
    for i in range(group["n"]):
        t = dict(
            prompt_id=group["prompt_id"],
            sample_index=i,
            prompt_token_ids=group["prompt_token_ids"],
            completion_token_ids=[12, 13, 2],
            logprobs=[-0.1, -2.0, -0.3],
            versions=[0, 0, 0],
            finish_reason="stop",
        )
        t.update(override)
        trajs.append(t)
    return {
        "lease_id": lease["lease_id"],
        "groups": [{"group_id": group["group_id"], "trajectories": trajs}],
    }


def test_worker_round_trip(service):
    ctl, server, client, secret, _ = service
    headers = register(client, secret)
    hb = client.post(
        "/v1/heartbeat", headers=headers, json={"worker_version": -1, "samples_per_s": 3.0}
    )
    assert hb.json()["swap_to"] is None and hb.json()["announcement"]["version"] == -1
    lease = _lease(ctl, client, headers)
    assert lease["groups"][0]["sampling"]["max_tokens"] == 4
    hb = client.post("/v1/heartbeat", headers=headers, json={"worker_version": -1}).json()
    assert hb["swap_to"] == 0 and hb["announcement"]["store"] == {"driver": "memory"}
    assert hb["renewed_leases"] == [lease["lease_id"]]
    body = _submission(lease)
    r = client.post("/v1/submit", headers=headers, json=body)
    assert r.status_code == 200 and r.json()["accepted"] == [lease["groups"][0]["group_id"]]
    r = client.post("/v1/submit", headers=headers, json=body)
    assert r.json()["accepted"] == [] and r.json()["duplicates"] == [body["groups"][0]["group_id"]]
    assert client.get("/v1/status", headers=headers).json()["groups/accepted"] == 1
    other = register(client, secret)
    assert client.post("/v1/submit", headers=other, json=body).status_code == 403
    r = client.post("/v1/release", headers=headers, json={"lease_id": lease["lease_id"]})
    assert r.status_code == 200 and r.json()["ok"] is False  # already done


@pytest.mark.parametrize(
    "override, status, needle",
    [
        (dict(completion_token_ids="abc"), 422, "completion_token_ids"),
        (dict(reward=1.0), 422, "reward"),  # a worker's reward is not even accepted
        (dict(completion_token_ids=[12, 13, 1000]), 422, "vocabulary"),
        (dict(logprobs=[-0.1, math.nan, -0.3]), 422, "logprobs"),
        (dict(logprobs=[-0.1, 0.5, -0.3]), 422, "<= 0"),
        (dict(reward=math.inf), 422, "reward"),
        (dict(versions=[0, 0, 3]), 422, "future"),
        (dict(finish_reason="exploded"), 422, "finish_reason"),
        (dict(surprise=1), 422, "surprise"),
        (
            dict(completion_token_ids=[3] * 9, logprobs=[-1.0] * 9, versions=[0] * 9),
            422,
            "max_tokens",
        ),
    ],
)
def test_malformed_submissions_change_nothing(service, override, status, needle):
    ctl, server, client, secret, _ = service
    headers = register(client, secret)
    lease = _lease(ctl, client, headers)
    before = dump(ctl)
    # json.dumps writes NaN/Infinity literals, as a careless client would.
    r = client.post(
        "/v1/submit",
        headers={**headers, "Content-Type": "application/json"},
        content=json.dumps(_submission(lease, **override)),
    )
    assert r.status_code == status and needle in r.text, r.text
    assert dump(ctl) == before
    # The same lease still takes a good submission afterwards.
    assert client.post("/v1/submit", headers=headers, json=_submission(lease)).status_code == 200


def test_oversized_and_unframed_bodies(service):
    ctl, server, client, secret, _ = service
    headers = register(client, secret)
    lease = _lease(ctl, client, headers)
    before = dump(ctl)
    big = _submission(lease, prompt_token_ids=[5] * 40_000)
    r = client.post("/v1/submit", headers=headers, json=big)
    assert r.status_code == 413
    r = client.post(
        "/v1/submit",
        headers={**headers, "Content-Type": "application/json"},
        content=iter([json.dumps(_submission(lease)).encode()]),
    )  # chunked
    assert r.status_code == 411
    r = client.post(
        "/v1/submit", headers={**headers, "Content-Type": "application/json"}, content=b"{not json"
    )
    assert r.status_code == 422
    assert dump(ctl) == before


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_tls(tmp_path):
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            key,
            "-out",
            cert,
        ],
        check=True,
        capture_output=True,
    )
    ctl = Controller(ControllerConfig(), str(tmp_path / "c.db"), make_task("arithmetic"))
    server = ControllerServer(ctl, "js", ServerOptions(certfile=cert, keyfile=key)).start()
    try:
        assert server.url.startswith("https://127.0.0.1:")
        with httpx.Client(
            base_url=server.url, verify=ssl.create_default_context(cafile=cert)
        ) as client:
            headers = register(client, "js")
            assert client.get("/v1/version", headers=headers).status_code == 200
        with pytest.raises(httpx.ConnectError):  # an untrusted cert is refused by default
            httpx.get(server.url + "/openapi.json")
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
            httpx.get(server.url.replace("https", "http") + "/openapi.json")
    finally:
        server.stop()
        ctl.close()
