"""GET /metrics on a real controller over HTTP (uvicorn on loopback, port 0): after leases,
submissions, a standby and a quarantined worker, every fleet gauge of one scrape equals what
`bridge.status` (GET /v1/status with the join secret) answers at the same injected time;
per-endpoint latency histograms count the requests made; a non-loopback caller is refused
without the metrics token and served with it."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bridge.control.http import prometheus
from bridge.control.http.service import ServerOptions, load_or_create_join_secret, serve_controller
from bridge.control.protocol import LeaseRequest
from bridge.control.trust import audit
from bridge.status import fetch_status
from tests.controller_helpers import Clock, make, submit_all, worker


def scrape(url, **kw) -> dict:
    """{(name, labels): value} of one scrape."""
    r = httpx.get(url + "/metrics", timeout=10, **kw)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(r.text)
        for s in fam.samples
    }


@pytest.fixture
def fleet(tmp_path):
    clock = Clock()
    ctl = make(tmp_path, clock, audit_min_tokens=20, worker_timeout_s=7200.0)
    ctl.publish(0)
    server = serve_controller(ctl, str(tmp_path), ServerOptions())
    secret = load_or_create_join_secret(str(tmp_path))
    yield ctl, clock, server, secret
    server.stop()
    ctl.close()


def test_scraped_gauges_equal_bridge_status(fleet):
    ctl, clock, server, secret = fleet
    a, b, standby = worker(ctl, price=2.0), worker(ctl, price=0.75), worker(ctl, price=0.5)
    cheat = worker(ctl, price=1.0)
    ctl.set_worker_enabled(standby, False)
    lease = ctl.lease(a, LeaseRequest(worker_version=0, max_groups=1)).lease
    assert submit_all(ctl, a, lease).accepted
    lease = ctl.lease(cheat, LeaseRequest(worker_version=0, max_groups=1)).lease
    assert submit_all(ctl, cheat, lease).accepted
    bad = audit.AuditStat(cheat, 0, tokens=40, sum_k3=40 * 3.0, sum_logratio=40 * 4.0)
    assert ctl.audit([bad]) == [cheat]
    clock.t += 1800.0  # half an hour of billing; nobody is silent past the timeout yet
    ctl.lease(b, LeaseRequest(worker_version=0, max_groups=1))  # stays in flight

    got = scrape(server.url)
    status = fetch_status(server.url, secret)  # what `python -m bridge.status` prints from
    run = status["run"]
    assert run["workers"]["quarantined"] == 1 and run["workers"]["standby"] == 1
    for state, n in run["workers"].items():
        assert got[("echo2_workers", (("state", state),))] == n
    for state in ("queued", "leased", "buffered"):
        assert got[("echo2_groups", (("state", state),))] == status[f"groups/{state}"]
    assert got[("echo2_leases_in_flight", ())] == status["groups/leased"] == 1
    assert got[("echo2_rollouts_per_second", ())] == status["fleet/rollouts_per_s"]
    assert got[("echo2_staleness_now", ())] == run["staleness_now"]
    assert got[("echo2_staleness_bound", ())] == run["staleness_bound"]
    assert got[("echo2_cost_usd_per_hour", ())] == run["spend_usd_per_hour"] > 0
    assert got[("echo2_cost_usd_total", ())] == run["spend_usd"] > 0
    assert got[("echo2_policy_version", ())] == run["policy_version"] == 0
    assert got[("echo2_learner_step", ())] == run["step"]
    assert got[("echo2_no_admissible_work", ())] == 0
    assert got[("echo2_learner_since_last_step_seconds", ())] >= 0.0
    assert got[("echo2_trajectories_accepted_total", ())] == status["trajectories/accepted"] > 0
    assert got[("echo2_leases_issued_total", ())] == status["leases/issued"] == 3
    assert got[("echo2_fleet_quarantined_total", ())] == 1
    # No version finished broadcasting (no worker reported one): NaN, not a made-up 0.
    latency = got[("echo2_broadcast_latency_seconds", ())]
    assert "broadcast/latency_s" not in status and latency != latency


def test_latency_histograms_per_endpoint(fleet):
    ctl, clock, server, secret = fleet
    fetch_status(server.url, secret)
    fetch_status(server.url, secret)
    httpx.get(server.url + "/v1/status")  # 401: timed too
    httpx.get(server.url + "/no/such/path/1")
    httpx.get(server.url + "/no/such/path/2")
    got = scrape(server.url)
    count = "echo2_http_request_duration_seconds_count"
    assert got[(count, (("code", "200"), ("endpoint", "/v1/status"), ("method", "GET")))] == 2
    assert got[(count, (("code", "401"), ("endpoint", "/v1/status"), ("method", "GET")))] == 1
    # Made-up paths share one label value instead of growing the series.
    assert got[(count, (("code", "401"), ("endpoint", "other"), ("method", "GET")))] == 2
    inf = (("code", "200"), ("endpoint", "/v1/status"), ("le", "+Inf"), ("method", "GET"))
    assert got[("echo2_http_request_duration_seconds_bucket", inf)] == 2


def test_non_loopback_needs_the_metrics_token(fleet, tmp_path):
    """The refusal rule on requests as they would arrive from another host (a real Starlette
    request with a non-loopback client address)."""
    from starlette.requests import Request

    def request(token=None, scheme="https"):
        headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
        return Request(
            {
                "type": "http",
                "method": "GET",
                "path": "/metrics",
                "headers": headers,
                "client": ("203.0.113.9", 5000),
                "scheme": scheme,
                "server": ("x", 443),
                "query_string": b"",
            }  # fmt: skip
        )

    token_file = tmp_path / "metrics_token"
    token_file.write_text("s3cret\n")
    assert prometheus._refusal(request(), None, False).status_code == 403
    assert prometheus._refusal(request("s3cret"), None, False).status_code == 403
    assert prometheus._refusal(request(), str(token_file), False).status_code == 401
    assert prometheus._refusal(request("wrong"), str(token_file), False).status_code == 401
    assert prometheus._refusal(request("s3cret"), str(token_file), False) is None
    plain = request("s3cret", scheme="http")
    assert prometheus._refusal(plain, str(token_file), False).status_code == 403
    assert prometheus._refusal(plain, str(token_file), True) is None
    loop = Request({"type": "http", "client": ("127.0.0.1", 1), "headers": [], "scheme": "http"})
    assert prometheus._refusal(loop, None, False) is None


def test_missing_token_file_refused_at_start(tmp_path):
    from fastapi import FastAPI

    with pytest.raises(ValueError, match="metrics_token_file"):
        prometheus.install(FastAPI(), dict, token_file=str(tmp_path / "nope"))
