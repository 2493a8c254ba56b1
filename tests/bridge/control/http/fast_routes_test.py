"""The lean heartbeat, lease and submit handlers (bridge/control/http/fast_routes.py, issue 25),
through real HTTP on loopback: the same replies as the FastAPI routes they bypass (fields,
values, status codes, error bodies), and a heartbeat answered on the event loop itself (no
pool thread, no FastAPI) while leases and submissions run on pool threads."""

import threading

import httpx
import pytest
from controller_helpers import Clock, make, register, submission_json

from bridge.control.http.http_guard import HttpGuard
from bridge.control.http.service import ServerOptions, load_or_create_join_secret, serve_controller


def _exchange(tmp_path, lean: bool):
    ctl = make(tmp_path, Clock())
    ctl.publish(0, {"driver": "memory"})
    threads = {}
    for name in ("heartbeat", "lease", "submit"):
        real = getattr(ctl, name)

        def spy(*args, _real=real, _name=name):
            threads[_name] = threading.current_thread().name
            return _real(*args)

        setattr(ctl, name, spy)
    server = serve_controller(ctl, str(tmp_path), ServerOptions(lean_routes=lean))
    guard = [m for m in server.app.user_middleware if m.cls is HttpGuard][0]
    out = {"fast_paths": sorted(guard.kwargs["fast"])}
    try:
        with httpx.Client(base_url=server.url, timeout=10) as client:
            headers = register(client, load_or_create_join_secret(str(tmp_path)))
            post = lambda path, body: client.post(path, headers=headers, json=body)  # noqa: E731
            for key, path, body in (
                ("lease", "/v1/lease", {"worker_version": 0, "max_groups": 1}),
                ("heartbeat", "/v1/heartbeat", {"worker_version": 0, "samples_per_s": 2.5}),
                ("bad_field", "/v1/heartbeat", {"worker_version": "x"}),
                ("extra_field", "/v1/lease", {"worker_version": 0, "nope": 1}),
                ("too_many", "/v1/lease", {"worker_version": 0, "max_groups": -1}),
            ):
                r = post(path, body)
                out[key] = (r.status_code, r.headers["content-type"], r.json())
            lease = out["lease"][2]["lease"]
            good = submission_json(lease)
            bad_lease = {**good, "lease_id": "not-a-lease"}
            bad_type = {**good, "groups": [{**good["groups"][0], "group_id": "x"}]}
            for key, body in (
                ("submit", good), ("resubmit", good), ("bad_lease", bad_lease),
                ("bad_submit", bad_type),
            ):  # fmt: skip
                r = post("/v1/submit", body)
                out[key] = (r.status_code, r.headers["content-type"], r.json())
            r = client.post("/v1/heartbeat", json={"worker_version": 0})  # no token
            out["no_token"] = (r.status_code, r.json())
            r = client.post("/v1/heartbeat", headers=headers, content=b"{not json")
            out["not_json"] = r.status_code
    finally:
        server.stop()
        ctl.close()
    return out, threads


def _ids_out(reply: dict) -> dict:
    """A reply without what differs between two runs (random ids, clock-free fields)."""
    if "accepted" in reply:
        return {**reply, "accepted": len(reply["accepted"]), "duplicates": len(reply["duplicates"])}
    lease = reply.get("lease")
    if lease:
        lease = {
            **lease,
            "lease_id": "-",
            # the sampling seed is drawn per lease (sampling_seeds.py)
            "groups": [
                {**g, "group_id": 0, "sampling": {**g["sampling"], "seed": 0}}
                for g in lease["groups"]
            ],
        }
    return {**reply, "lease": lease, "renewed_leases": len(reply.get("renewed_leases", []))}


KEYS = ["lease", "heartbeat", "bad_field", "extra_field", "too_many"]
KEYS += ["submit", "resubmit", "bad_lease", "bad_submit"]


@pytest.mark.parametrize("key", KEYS)
def test_lean_replies_equal_the_fastapi_routes(key, lean_and_plain):
    lean, plain = lean_and_plain
    status, ctype, body = lean[key]
    assert (status, ctype) == plain[key][:2]
    if status == 200:
        assert _ids_out(body) == _ids_out(plain[key][2])
    else:
        assert status in (404, 422) and body == plain[key][2]


def test_error_paths_and_where_each_runs(lean_and_plain, lean_threads):
    lean, plain = lean_and_plain
    assert lean["fast_paths"] == ["/v1/heartbeat", "/v1/lease", "/v1/submit"]
    assert plain["fast_paths"] == []
    assert lean["no_token"] == plain["no_token"] and lean["no_token"][0] == 401
    assert lean["not_json"] == plain["not_json"] == 422
    assert lean["heartbeat"][2]["renewed_leases"] == [lean["lease"][2]["lease"]["lease_id"]]
    lean_t, plain_t = lean_threads
    assert not lean_t["heartbeat"].startswith(("AnyIO", "lease", "submit"))  # on the loop
    # Each on its own lane of threads (fast_routes.on_thread); FastAPI's on anyio's pool.
    assert lean_t["lease"].startswith("lease") and plain_t["heartbeat"].startswith("AnyIO")
    assert lean_t["submit"].startswith("submit")  # parsed and scored off the loop
    assert lean["submit"][2]["accepted"] and lean["resubmit"][2]["duplicates"]


@pytest.fixture(scope="module")
def _both(tmp_path_factory):
    lean = _exchange(tmp_path_factory.mktemp("lean"), True)
    plain = _exchange(tmp_path_factory.mktemp("plain"), False)
    return lean, plain


@pytest.fixture
def lean_and_plain(_both):
    return _both[0][0], _both[1][0]


@pytest.fixture
def lean_threads(_both):
    return _both[0][1], _both[1][1]
