"""The controller over real HTTP (uvicorn on loopback, port 0) with an httpx client:
auth on every endpoint, join secret, malformed submissions, size limit, TLS, schema."""

import json
import math
import os
import shutil
import ssl
import stat
import subprocess
import threading
import time

import httpx
import pytest

from bridge.control.client import ControllerClient, ControllerError
from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.protocol import (
    GroupResult,
    Heartbeat,
    LeaseRequest,
    SamplingParams,
    Submission,
    WorkerProfile,
    WorkerTrajectory,
)
from bridge.control.service import (
    ControllerServer,
    ServerOptions,
    load_or_create_join_secret,
    serve_controller,
)
from bridge.model import tiny_model
from bridge.model.tiny_model import EOS_ID, char_vocab
from bridge.tasks import make_task

PROFILE = {
    "accelerator": "cpu",
    "price_per_hour": 0.5,
    "max_concurrent_sequences": 16,
    "region": "local",
}


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


def register(client, secret):
    r = client.post("/v1/register", json={"join_secret": secret, "profile": PROFILE})
    assert r.status_code == 200, r.text
    return {"Authorization": f"Bearer {r.json()['token']}"}


def dump(ctl):
    return list(ctl.store.conn.iterdump())


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


def two_token_results(groups, **fields):
    """Typed results for leased `groups`, every sample a two-token completion at version 0;
    `fields` override WorkerTrajectory fields (a callable gets the sample index)."""
    return [
        GroupResult(
            group_id=g.group_id,
            trajectories=[
                WorkerTrajectory(
                    **{
                        "prompt_id": g.prompt_id,
                        "sample_index": i,
                        "prompt_token_ids": g.prompt_token_ids,
                        "completion_token_ids": [6, 2],
                        "logprobs": [-1.0, -0.5],
                        "versions": [0, 0],
                        "finish_reason": "stop",
                        **{k: v(i) if callable(v) else v for k, v in fields.items()},
                    }
                )
                for i in range(g.n)
            ],
        )
        for g in groups
    ]


def test_typed_client_round_trip_with_controller_rewards(service):
    """What a worker does, through the typed client: join, swap when told, lease, generate
    from the leased prompt ids, submit; the learner then takes those trajectories with the
    controller's own rewards (the worker never sees an answer)."""
    ctl, server, _, secret, _ = service
    with pytest.raises(ControllerError) as e:
        ControllerClient.join(server.url, "wrong", WorkerProfile(**PROFILE))
    assert e.value.status == 403
    client, reg = ControllerClient.join(server.url, secret, WorkerProfile(**PROFILE))
    assert reg.announcement.version == -1 and reg.lease_ttl_s == ctl.config.lease_ttl_s
    ctl.publish(0, {"driver": "memory"})
    r = client.lease(LeaseRequest(worker_version=-1, max_groups=2))
    assert r.lease is None and r.reason == "behind" and r.swap_to == 0
    assert client.heartbeat(Heartbeat(worker_version=0, samples_per_s=2.5)).swap_to is None
    lease = client.lease(LeaseRequest(worker_version=0, max_groups=2)).lease
    vocab = char_vocab()
    results, expected = [], {}
    for g in lease.groups:
        assert g.prompt_token_ids == [tiny_model.BOS_ID] + [vocab[ch] for ch in g.prompt]
        # The reference answer lives only in the controller's database.
        [row] = ctl.store.q("SELECT answer FROM groups WHERE group_id=?", (g.group_id,))
        trajs = []
        for i, text in enumerate([row["answer"], "-1"][: g.n]):  # right; wrong (answers >= 0)
            ids = [vocab[ch] for ch in text] + [EOS_ID]
            trajs.append(
                WorkerTrajectory(
                    prompt_id=g.prompt_id,
                    sample_index=i,
                    prompt_token_ids=g.prompt_token_ids,
                    completion_token_ids=ids,
                    logprobs=[-0.25] * len(ids),
                    versions=[0] * len(ids),
                    finish_reason="stop",
                )
            )
        expected[g.group_id] = [1.0, 0.1]  # 0.1: format_reward for a wrong number
        results.append(GroupResult(group_id=g.group_id, trajectories=trajs))
    sub = Submission(lease_id=lease.lease_id, groups=results)
    assert client.submit(sub).accepted == list(expected)
    assert client.submit(sub).duplicates == list(expected)
    assert client.status()["fleet/rollouts_per_s"] == 2.5
    batch, stats = ctl.take_batch(0, 2)
    assert {g.group_id: [t.reward for t in g.trajectories] for g in batch} == expected
    assert batch[0].trajectories[0].completion_token_ids[-1] == EOS_ID
    assert {g.worker_id for g in batch} == {reg.worker_id}
    client.leave()
    client.close()


def test_concurrent_workers_and_learner(tmp_path, text_codec):
    """Three workers over HTTP race a learner that publishes every step: no deadlock, every
    batch fresh, no group consumed twice."""
    S, g, steps = 1, 2, 8
    ctl = Controller(
        ControllerConfig(
            staleness=S,
            groups_per_step=g,
            group_size=2,
            retry_after_s=0.01,
            sampling=SamplingParams(max_tokens=4),
        ),
        str(tmp_path / "c.db"),
        make_task("arithmetic"),
        codec=text_codec,
    )
    server = serve_controller(ctl, str(tmp_path), ServerOptions())
    secret = load_or_create_join_secret(str(tmp_path))
    ctl.publish(0)
    stop, errors = threading.Event(), []

    def work():
        client, reg = ControllerClient.join(server.url, secret, WorkerProfile(**PROFILE))
        version = reg.announcement.version
        try:
            while not stop.is_set():
                r = client.lease(LeaseRequest(worker_version=version, max_groups=2))
                if r.swap_to is not None:
                    version = r.swap_to  # "swap" weights
                if r.lease is None:
                    time.sleep(r.retry_after_s)
                    continue
                groups = two_token_results(r.lease.groups, versions=[version] * 2)
                client.submit(Submission(lease_id=r.lease.lease_id, groups=groups))
        except Exception as e:  # noqa: BLE001 - surfaced by the assert below
            errors.append(e)
        finally:
            client.close()

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    consumed = []
    try:
        for step in range(steps):
            batch, stats = ctl.wait_batch(step, g, timeout_s=30)
            assert batch is not None, stats
            assert stats["staleness/max"] <= S
            consumed += [grp.group_id for grp in batch]
            ctl.publish(step + 1)
    finally:
        stop.set()
        for t in threads:
            t.join()
        server.stop()
        ctl.close()
    assert not errors, errors
    assert len(consumed) == steps * g and len(set(consumed)) == len(consumed)


def test_restart_between_steps_keeps_tokens_and_trajectories(tmp_path, text_codec):
    """Stop the service mid-run and start a new one on the same workdir: the worker's token
    still works, accepted trajectories are all there, consumed ones never come back."""

    def start():
        ctl = Controller(
            ControllerConfig(
                staleness=4, groups_per_step=1, group_size=2, sampling=SamplingParams(max_tokens=4)
            ),
            str(tmp_path / "controller.db"),
            make_task("arithmetic"),
            codec=text_codec,
        )
        return ctl, serve_controller(ctl, str(tmp_path), ServerOptions())

    ctl, server = start()
    ctl.publish(0)
    client, _ = ControllerClient.join(
        server.url, load_or_create_join_secret(str(tmp_path)), WorkerProfile(**PROFILE)
    )
    lease = client.lease(LeaseRequest(worker_version=0, max_groups=3)).lease
    groups = two_token_results(
        lease.groups,
        completion_token_ids=lambda i: [6, i + 7],
        logprobs=[-1.0, -2.0],
        finish_reason="length",
    )
    sub = Submission(lease_id=lease.lease_id, groups=groups)
    client.submit(sub)
    first, _ = ctl.take_batch(0, 1)
    cursor = ctl.export_cursor()  # the learner checkpoints after step 0
    server.stop()
    ctl.close()
    client.close()

    ctl, server = start()
    try:
        ctl.restore_cursor(cursor)
        with open(tmp_path / "controller.json") as f:
            url = json.load(f)["url"]
        assert url == server.url
        client = ControllerClient(url, client.token)
        assert client.submit(sub).duplicates == [g.group_id for g in groups]
        rest = [ctl.take_batch(step, 1)[0] for step in (1, 2)]
        assert ctl.take_batch(3, 1)[0] is None
        got = [b[0] for b in [first, *rest]]
        assert [g.group_id for g in got] == [g.group_id for g in groups]
        unscored = {"reward", "reward_error"}
        assert [[t.model_dump(exclude=unscored) for t in g.trajectories] for g in got] == [
            [t.model_dump() for t in g.trajectories] for g in groups
        ]
        client.close()
    finally:
        server.stop()
        ctl.close()
