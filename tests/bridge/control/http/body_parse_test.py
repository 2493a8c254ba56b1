"""Request bodies through the public interface (real HTTP on loopback): what a parse may
cost is bounded by the body's bytes before it starts, and a large submission is scanned and
parsed in a parser process, not on the server's GIL (bridge/control/http/body_parse.py); what
the server rebuilds from the parser's packed arrays is the model pydantic validates, built
only for a lease the worker holds and freed off the event loop; the budgets hold on that path,
and a parser killed between bodies is replaced."""

import contextlib
import json
import os
import signal
import threading
import time
import weakref

import httpx
import pytest
from controller_helpers import dump, make, register

from bridge.control.http import service as service_lib
from bridge.control.http.body_parse import parse_submission_packed, rebuild_submission
from bridge.control.http.service import ServerOptions, serve_controller
from bridge.control.protocol import Submission


@pytest.fixture
def served(tmp_path):
    """A controller whose bodies of 1 KiB and more go to the parser processes."""
    ctl = make(tmp_path)
    opts = ServerOptions(max_body_bytes=8 << 20, parse_offload_bytes=1 << 10)
    server = serve_controller(ctl, str(tmp_path), opts)
    secret = service_lib.load_or_create_join_secret(str(tmp_path))
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield ctl, server, client, register(client, secret)
    server.stop()
    ctl.close()


def test_a_body_of_nested_empty_arrays_is_refused_before_it_is_parsed(served):
    """4 MiB of `[],`: 1.4 M containers (within the element budget), ~35x its size once
    parsed; refused for its containers per byte, on the raw bytes."""
    ctl, _, client, headers = served
    before = dump(ctl)
    body = b'{"lease_id": "x", "groups": [' + b",".join([b"[]"] * ((4 << 20) // 3)) + b"]}"
    h = {**headers, "Content-Type": "application/json"}
    r = client.post("/v1/submit", headers=h, content=body)
    assert r.status_code == 413 and "containers" in r.text, r.text[:200]
    r = client.post("/v1/episode", headers=h, content=body)  # any path's large body
    assert r.status_code == 413 and "containers" in r.text, r.text[:200]
    assert dump(ctl) == before


def test_a_body_that_costs_more_than_its_budget_to_parse_is_refused(served):
    """4 MiB of `[0,0,0]` lists passes the byte-level bounds but costs ~43x its size in
    the parser: refused (413) by the parser's memory budget; the next body is parsed."""
    ctl, _, client, headers = served
    h = {**headers, "Content-Type": "application/json"}
    body = b'{"lease_id": "x", "groups": [' + b",".join([b"[0,0,0]"] * (1 << 19)) + b"]}"
    r = client.post("/v1/submit", headers=h, content=body)
    assert r.status_code == 413 and "to parse" in r.text, r.text[:200]
    traj = dict(
        prompt_id="p", sample_index=0, prompt_token_ids=[1], completion_token_ids=[1000] * 8,
        logprobs=[-0.5] * 8, versions=[0] * 8, finish_reason="stop",
    )  # fmt: skip
    groups = [{"group_id": g, "trajectories": [traj] * 1000} for g in range(20)]  # ~4 MiB
    r = client.post("/v1/submit", headers=headers, json={"lease_id": "x", "groups": groups})
    assert r.status_code == 404 and "unknown lease" in r.text, r.text[:200]


def test_paths_parsed_on_the_event_loop_take_small_bodies_only(served):
    """A heartbeat is parsed on the event loop: a 2 MiB one is refused unread (413), not
    parsed there; a submission of that size is taken."""
    _, _, client, headers = served
    h = {**headers, "Content-Type": "application/json"}
    pad = json.dumps({"worker_version": 0, "relay_url": "x" * (2 << 20)})
    r = client.post("/v1/heartbeat", headers=h, content=pad)
    assert r.status_code == 413 and "exceeds 1048576" in r.text, r.text[:200]
    sub = json.dumps({"lease_id": "x" * (2 << 20), "groups": []})
    assert client.post("/v1/submit", headers=h, content=sub).status_code == 422


def _lease(ctl, client, headers) -> dict:
    ctl.publish(0, {"driver": "memory"})
    r = client.post("/v1/lease", headers=headers, json={"worker_version": 0, "max_groups": 1})
    assert r.status_code == 200, r.text
    return r.json()["lease"]


def test_a_large_submission_is_parsed_in_a_parser_process(served):
    """With the parser processes stopped, a large submission waits and a heartbeat is
    answered; resumed, the submission is accepted."""
    ctl, server, client, headers = served
    h = {**headers, "Content-Type": "application/json"}
    invalid = json.dumps({"lease_id": "x" * 2000, "groups": []})  # starts the parsers
    r = client.post("/v1/submit", headers=h, content=invalid)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][0] == "body", r.text
    lease = _lease(ctl, client, headers)
    groups = []
    for g in lease["groups"]:
        trajs = [
            dict(
                prompt_id=g["prompt_id"],
                sample_index=i,
                prompt_token_ids=g["prompt_token_ids"],
                completion_token_ids=[12, 13, 2],
                logprobs=[-0.1, -2.0, -0.3],
                versions=[0, 0, 0],
                finish_reason="stop",
            )
            for i in range(g["n"])
        ]
        groups.append({"group_id": g["group_id"], "trajectories": trajs})
    body = json.dumps({"lease_id": lease["lease_id"], "groups": groups}).encode()
    body = body[:-1] + b" " * 2048 + b"}"  # past the 1 KiB threshold
    parsers = server.app.state.parse_pool.pids()
    assert parsers, "no parser process"
    for pid in parsers:
        os.kill(pid, signal.SIGSTOP)
    replies = []
    t = threading.Thread(
        target=lambda: replies.append(
            httpx.post(server.url + "/v1/submit", headers=h, content=body, timeout=60)
        )
    )
    try:
        t.start()
        hb = client.post("/v1/heartbeat", headers=headers, json={"worker_version": 0})
        assert hb.status_code == 200, hb.text
        t.join(0.5)
        assert not replies  # the submission is in a stopped parser
    finally:
        for pid in parsers:
            os.kill(pid, signal.SIGCONT)
    t.join(60)
    assert replies[0].status_code == 200, replies[0].text
    assert replies[0].json()["accepted"] == [g["group_id"] for g in lease["groups"]]


def test_the_rebuilt_submission_is_what_pydantic_validates():
    traj = dict(
        prompt_id="p",
        sample_index=3,
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[5, 2**31 + 7, 9],  # past 32 bits: packed as 64
        logprobs=[-0.1, -1e-300, -123.456789012345678],
        versions=[0, 4, 4],
        finish_reason="length",
    )
    huge = dict(traj, completion_token_ids=[1, 2**70, 3])  # past 64 bits: kept as a list
    masked = dict(traj, completion_mask=[1, 0, 1])
    edges = dict(traj, completion_token_ids=[-(2**31), 2**31 - 1, 0], versions=[-(2**31) - 1, 0, 1])
    body = json.dumps(
        {
            "lease_id": "L",
            "groups": [
                {"group_id": 7, "trajectories": [traj, huge]},
                {"group_id": -2, "trajectories": [masked, edges]},
            ],
        }
    ).encode()
    kind, packed = parse_submission_packed(body, 32, 1000)
    assert kind == "ok"
    rebuilt, validated = rebuild_submission(packed), Submission.model_validate_json(body)
    assert rebuilt == validated
    assert rebuilt.model_dump_json() == validated.model_dump_json()
    for a, b in zip(rebuilt.groups, validated.groups, strict=True):
        for x, y in zip(a.trajectories, b.trajectories, strict=True):
            assert x.model_fields_set == y.model_fields_set
            assert [type(v) for v in x.logprobs] == [float] * 3
            assert {type(v) for v in x.completion_token_ids + x.versions} == {int}
    assert parse_submission_packed(b'{"lease_id": 1}', 32, 1000)[:2] == ("refused", 422)


_UNKNOWN = {
    "lease_id": "nope",
    "groups": [
        {
            "group_id": 0,
            "trajectories": [
                dict(
                    prompt_id="p",
                    sample_index=0,
                    prompt_token_ids=[1],
                    completion_token_ids=[5],
                    logprobs=[-0.5],
                    versions=[0],
                    finish_reason="stop",
                )
            ],
        }
    ],
}


def _padded(doc: dict) -> bytes:
    """`doc` as JSON past the fixture's 1 KiB threshold (trailing spaces)."""
    body = json.dumps(doc).encode()
    return body[:-1] + b" " * 2048 + b"}"


def test_a_large_submission_for_a_lease_not_held_is_refused_before_it_is_built(served):
    """Parsed in a parser process, then refused for its lease (404, the words of the small
    body's refusal) before the server builds its per-token Python objects; a submission for
    a lease the worker holds is built and accepted."""
    ctl, server, client, headers = served
    pool = server.app.state.parse_pool
    h = {**headers, "Content-Type": "application/json"}
    small = client.post("/v1/submit", headers=h, json=_UNKNOWN)
    assert small.status_code == 404, small.text
    before, parsed, rebuilt = dump(ctl), pool.parsed, pool.rebuilt
    r = client.post("/v1/submit", headers=h, content=_padded(_UNKNOWN))
    assert (r.status_code, r.json()) == (404, small.json())
    assert (pool.parsed, pool.rebuilt) == (parsed + 1, rebuilt)
    assert dump(ctl) == before
    lease = _lease(ctl, client, headers)
    r = client.post("/v1/submit", headers=h, content=_padded(_groups(lease)))
    assert r.status_code == 200, r.text
    assert (pool.parsed, pool.rebuilt) == (parsed + 2, rebuilt + 1)


def _groups(lease: dict, token: int = 12) -> dict:
    groups = [
        {
            "group_id": g["group_id"],
            "trajectories": [
                dict(
                    prompt_id=g["prompt_id"],
                    sample_index=i,
                    prompt_token_ids=g["prompt_token_ids"],
                    completion_token_ids=[token, 13, 2],
                    logprobs=[-0.1, -2.0, -0.3],
                    versions=[0, 0, 0],
                    finish_reason="stop",
                )
                for i in range(g["n"])
            ],
        }
        for g in lease["groups"]
    ]
    return {"lease_id": lease["lease_id"], "groups": groups}


def test_large_bodies_past_the_element_or_nesting_budget_are_refused_by_the_parser(served):
    """The budgets hold on the parser process's path too: refused (413), nothing changed."""
    ctl, server, client, headers = served
    h = {**headers, "Content-Type": "application/json"}
    before, parsed = dump(ctl), server.app.state.parse_pool.parsed
    deep = b'{"lease_id": "x", "groups": ' + b"[" * 40 + b"]" * 40 + b"}"
    r = client.post("/v1/submit", headers=h, content=deep + b" " * 2048)
    assert r.status_code == 413 and "nested deeper than 32" in r.text, r.text[:200]
    many = b'{"lease_id": "x", "groups": [[' + b",".join([b"0"] * 4_000_001) + b"]]}"
    r = client.post("/v1/submit", headers=h, content=many)
    assert r.status_code == 413 and "more than 4000000 elements" in r.text, r.text[:200]
    assert server.app.state.parse_pool.parsed == parsed + 2
    assert dump(ctl) == before


def test_a_refused_large_submission_is_freed_off_the_event_loop(served, monkeypatch):
    """A submission the controller refuses (422: a token outside the vocabulary) after the
    server built it is freed on the submission's pool thread, not on the event loop
    (the thread named "controller"), where freeing ~2 M objects would stall every request."""
    ctl, _, client, headers = served
    lease = _lease(ctl, client, headers)
    freed_on: list[str] = []
    real_submit = ctl.submit

    def submit(worker, sub):  # the real submit; each trajectory reports where it is freed
        for g in sub.groups:
            for t in g.trajectories:
                weakref.finalize(t, lambda: freed_on.append(threading.current_thread().name))
        return real_submit(worker, sub)

    monkeypatch.setattr(ctl, "submit", submit)
    h = {**headers, "Content-Type": "application/json"}
    r = client.post("/v1/submit", headers=h, content=_padded(_groups(lease, token=100)))
    assert r.status_code == 422 and "outside the vocabulary" in r.text, r.text
    n = sum(g["n"] for g in lease["groups"])
    assert len(freed_on) == n and "controller" not in freed_on, freed_on


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_a_parser_killed_while_idle_is_replaced_and_the_body_parsed(served):
    """A parser process killed between bodies (an OOM kill, an operator) is replaced at
    the next large body, which is parsed (its real answer: 404), not refused."""
    _, server, client, headers = served
    h = {**headers, "Content-Type": "application/json"}
    body = _padded(_UNKNOWN)
    assert client.post("/v1/submit", headers=h, content=body).status_code == 404
    pool = server.app.state.parse_pool
    killed = pool.pids()
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not all(_gone(pid) for pid in killed):
        assert time.monotonic() < deadline, "the parser processes did not die"
        time.sleep(0.05)
    for _ in killed:  # each parser in turn
        r = client.post("/v1/submit", headers=h, content=body)
        assert r.status_code == 404, r.text
    assert not set(pool.pids()) & set(killed)


def test_a_parser_that_does_not_answer_is_replaced_and_the_body_answered_503(tmp_path):
    """A stopped parser (hung, or starved) holds a submission no longer than the pool's
    timeout: 503 with the reason, the parser killed and replaced; the next body is parsed."""
    ctl = make(tmp_path)
    opts = ServerOptions(parse_offload_bytes=1 << 10, parse_processes=1, parse_timeout_s=2.0)
    server = serve_controller(ctl, str(tmp_path), opts)
    secret = service_lib.load_or_create_join_secret(str(tmp_path))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            headers = register(client, secret)
            h = {**headers, "Content-Type": "application/json"}
            body = _padded(_UNKNOWN)
            assert client.post("/v1/submit", headers=h, content=body).status_code == 404
            (stopped,) = server.app.state.parse_pool.pids()
            os.kill(stopped, signal.SIGSTOP)
            try:
                r = client.post("/v1/submit", headers=h, content=body)
            finally:
                with contextlib.suppress(ProcessLookupError):  # killed and reaped by now
                    os.kill(stopped, signal.SIGCONT)
            assert r.status_code == 503 and "did not answer within 2 s" in r.text, r.text
            assert server.app.state.parse_pool.pids() != [stopped]
            assert client.post("/v1/submit", headers=h, content=body).status_code == 404
    finally:
        server.stop()
        ctl.close()
