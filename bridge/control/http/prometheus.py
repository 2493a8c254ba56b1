"""Prometheus text at `GET /metrics` on the controller's own port (prometheus-client).

    echo2_workers{state}                   workers by state, as `python -m bridge.status` counts
    echo2_rollouts_per_second              measured rollouts/s of the active workers
    echo2_leases_in_flight                 prompt groups leased and not yet back
    echo2_groups{state}                    queued / leased / buffered prompt groups
    echo2_staleness_now, _bound            learner step - oldest buffered version; the bound S
    echo2_cost_usd_per_hour                hourly price of the workers not gone or quarantined
    echo2_cost_usd_total                   fleet spend so far
    echo2_broadcast_latency_seconds        publish -> last live worker holding the version
    echo2_policy_version, echo2_learner_step
    echo2_learner_since_last_step_seconds  since the learner's last train step (a stall's length)
    echo2_no_admissible_work               1 while no live worker can be given servable work
    echo2_<counter>_total                  the controller's cumulative counters (leases/issued..)
    echo2_http_request_duration_seconds    per endpoint, method and status code (histogram)

Every gauge of one scrape comes from one `controller.status()` (one read under the
controller's lock), the same dict `GET /v1/status` answers, so a scrape and bridge.status
agree. Values that do not exist yet (no buffered group, no broadcast finished) are NaN.

Who may read it: loopback callers; others only with the bearer token in
`controller.metrics_token_file` (and, like every other path, over TLS unless
`controller.allow_plain_http`). With no token file, non-loopback scrapes get 403.

The endpoint label is the route's path for the app's own routes and "other" for anything
else, so callers cannot grow the label set by asking for made-up paths.
"""

from __future__ import annotations

import hmac
import math
import os
import time
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from bridge.broadcast.relay_address import is_loopback

PATH = "/metrics"
# The controller's cumulative counters (stats_line.py COUNTERS) exported as *_total.
COUNTERS = (
    "trajectories/accepted",
    "groups/accepted",
    "groups/consumed",
    "groups/duplicate",
    "leases/issued",
    "leases/expired",
    "leases/released",
    "staleness/dropped",
    "reward/errors",
    "reward/timeouts",
    "fleet/quarantined",
    "audit/dropped_groups",
    "fleet/rate_limited",
)


def _num(v) -> float:
    return math.nan if v is None else float(v)


def _gauge(name: str, doc: str, value) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=_num(value))


class FleetCollector:
    """Turns one `status()` dict (bridge/control/fleet/fleet_status.py) into metric families."""

    def __init__(self, status: Callable[[], dict]):
        self.status = status

    def collect(self):
        st = self.status()
        run = st["run"]
        workers = GaugeMetricFamily("echo2_workers", "Workers by state", labels=["state"])
        for state, n in run["workers"].items():
            workers.add_metric([state], n)
        yield workers
        groups = GaugeMetricFamily("echo2_groups", "Prompt groups by state", labels=["state"])
        for state in ("queued", "leased", "buffered"):
            groups.add_metric([state], st.get(f"groups/{state}", 0))
        yield groups
        yield _gauge(
            "echo2_rollouts_per_second",
            "Measured rollouts/s of the active workers",
            st.get("fleet/rollouts_per_s", 0.0),
        )
        yield _gauge("echo2_leases_in_flight", "Groups leased, not back", st.get("groups/leased"))
        yield _gauge(
            "echo2_staleness_now",
            "Learner step minus the oldest buffered version",
            run["staleness_now"],
        )
        yield _gauge("echo2_staleness_bound", "The staleness bound S", run["staleness_bound"])
        yield _gauge(
            "echo2_cost_usd_per_hour", "Hourly price of the live fleet", run["spend_usd_per_hour"]
        )
        yield CounterMetricFamily("echo2_cost_usd", "Fleet spend so far", value=run["spend_usd"])
        yield _gauge(
            "echo2_broadcast_latency_seconds",
            "Publish to the last live worker holding the newest finished version",
            st.get("broadcast/latency_s"),
        )
        yield _gauge("echo2_policy_version", "Newest published version", run["policy_version"])
        yield _gauge("echo2_learner_step", "The learner step the buffer is filled for", run["step"])
        yield _gauge(
            "echo2_learner_since_last_step_seconds",
            "Seconds since the learner's last train step",
            st.get("learner/since_last_step_s"),
        )
        yield _gauge(
            "echo2_no_admissible_work",
            "1 while no live worker can be given work it could serve (liveness.py)",
            st.get("fleet/no_admissible_work"),
        )
        for key in COUNTERS:
            if key in st:
                name = "echo2_" + key.replace("/", "_")
                yield CounterMetricFamily(name, f"Controller counter {key}", value=st[key])


def _bearer(request: Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _refusal(request: Request, token_file: str | None, allow_plain_http: bool):
    """None when the caller may read /metrics, else the response that says why not."""
    if is_loopback(request.client.host if request.client else ""):
        return None
    if request.url.scheme != "https" and not allow_plain_http:
        return JSONResponse({"detail": "plain HTTP from a non-loopback address"}, 403)
    if not token_file:
        return JSONResponse({"detail": "/metrics is loopback-only (metrics_token_file)"}, 403)
    with open(token_file) as f:  # re-read: the token can be rotated by rewriting the file
        expected = f.read().strip()
    given = _bearer(request)
    if not expected or not given or not hmac.compare_digest(given, expected):
        return JSONResponse(
            {"detail": "missing or invalid metrics token"},
            401,
            headers={"WWW-Authenticate": "Bearer"},
        )
    return None


def install(
    app: FastAPI,
    status: Callable[[], dict],
    *,
    token_file: str | None = None,
    allow_plain_http: bool = False,
) -> CollectorRegistry:
    """Serve `GET /metrics` from `app` and time every request. Added last, the middleware is
    the outermost: it answers /metrics before the worker-token guard and times the guard's
    refusals too. Returns the registry (one per app: two controllers in a process do not
    share series)."""
    if token_file and not os.path.isfile(token_file):
        raise ValueError(f"controller.metrics_token_file {token_file!r} is not a file")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FleetCollector(status))
    latency = Histogram(
        "echo2_http_request_duration_seconds",
        "Controller HTTP request latency",
        ["endpoint", "method", "code"],
        registry=registry,
        buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    )
    known = {getattr(r, "path", "") for r in app.routes} | {PATH}

    class PrometheusMetrics:
        """Pure ASGI, not `@app.middleware("http")` (Starlette's BaseHTTPMiddleware): that
        one's per-request task and body stream cost ~16% of the controller's CPU under
        load (issue 25, BUILD_NOTES.md)."""

        def __init__(self, inner):
            self.inner = inner

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.inner(scope, receive, send)
            path, method, t0, code = scope["path"], scope["method"], time.perf_counter(), [500]

            async def timed_send(message):
                if message["type"] == "http.response.start":
                    code[0] = message["status"]
                await send(message)

            try:
                if path == PATH and method == "GET":
                    response = _refusal(Request(scope), token_file, allow_plain_http)
                    if response is None:
                        body = await run_in_threadpool(generate_latest, registry)
                        response = Response(body, media_type=CONTENT_TYPE_LATEST)
                    await response(scope, receive, timed_send)
                else:
                    await self.inner(scope, receive, timed_send)
            finally:
                endpoint = path if path in known else "other"
                latency.labels(endpoint, method, str(code[0])).observe(time.perf_counter() - t0)

    app.add_middleware(PrometheusMetrics)
    return registry
