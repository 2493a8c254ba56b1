"""The controller's HTTP service: FastAPI app + a uvicorn server on a background thread.

The training binary starts it next to the learner:

    server = serve_controller(controller, workdir, ServerOptions(host=..., port=...),
                              token_file=config.controller.token_file or None)
    server.url                                # also in <workdir>/controller.json
    ...
    server.stop()

Security: POST /v1/register takes the join secret (constant-time compare) and hands out a
per-worker bearer token; the controller stores only its SHA-256. A middleware answers
401 on every other path without a valid token before any body is parsed, and 413 for a
body over `max_body_bytes` (411 when a body has no Content-Length; counted as it arrives
whatever its framing, JSON depth and size bounded: http_guard.py). GET /v1/status
(read-only) also takes the join secret as bearer, for `python -m bridge.status`: the
whole fleet table; with a worker's token it shows the run and that worker's own row, not
other workers' names or identities. For WAN use pass
`certfile`/`keyfile` and the server speaks HTTPS. Abuse limits (bridge/control/trust/limits.py):
429 + Retry-After past a per-worker (per client IP for /v1/register) request rate, checked
before any body is parsed. The join secret is re-read when its file changes, the old one
accepted for a grace period (bridge/control/trust/join_secret.py). The schema is public at
/openapi.json; the interactive docs pages are off (they would be unauthenticated endpoints).

Transport (issue 23 item 12): over plain HTTP anyone on the path can rewrite the announced
store URL (and read the tokens), so a plain-HTTP request from a non-loopback address is
refused (403, before any body is parsed) unless `allow_plain_http` (the training binary's
`controller.allow_plain_http`); serve HTTPS with `controller.tls_cert`/`controller.tls_key`.
A worker's advertised relay URL becomes the address it called from (or an allow-listed
host, `relay_hosts`; bridge/broadcast/relay_address.py). X-Forwarded-For / -Proto are read
only from the proxies `trusted_proxies` names (`controller.trusted_proxies`; default none):
uvicorn's own default believes them from 127.0.0.1, so any local forwarder would let a
worker pick the address it is known and routed to. Worker-supplied strings are logged
escaped (bridge/control/trust/log_text.py).

The service parses, authenticates, calls the controller and serializes; the decisions
(scoring, hidden-token accounting, replanning) are the controller's.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import logging
import os
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from bridge.broadcast.relay_address import is_loopback
from bridge.control.controller import Controller
from bridge.control.http import prometheus
from bridge.control.http.body_parse import (
    BodyRefused,
    ParsePool,
    free_in_pieces,
    without_frames,
)
from bridge.control.http.fast_routes import RelayFilter, fast_routes
from bridge.control.http.http_bounds import bounded_protocol
from bridge.control.http.http_guard import HttpGuard, json_body, with_schemas
from bridge.control.http.version_news import VersionNews
from bridge.control.intake.episode_steps import OverBudget
from bridge.control.intake.validation import SubmissionError
from bridge.control.protocol import (
    Ack,
    EpisodeStep,
    EpisodeStepResponse,
    Heartbeat,
    HeartbeatResponse,
    LeaseRequest,
    LeaseResponse,
    RegisterRequest,
    RegisterResponse,
    Release,
    Submission,
    SubmitResponse,
    VersionAnnouncement,
)
from bridge.control.trust import limits
from bridge.control.trust.identity import LOCAL, identity_of
from bridge.control.trust.join_secret import JoinSecret, load_or_create_join_secret
from bridge.control.trust.log_text import log_safe

PUBLIC_PATHS = frozenset({"/v1/register", "/openapi.json"})
# Read-only paths an operator may also read with the join secret as bearer
# (python -m bridge.status): whoever holds the secret may join the fleet anyway.
OPERATOR_PATHS = frozenset({"/v1/status"})


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 0  # 0 = any free port
    certfile: str | None = None
    keyfile: str | None = None
    max_body_bytes: int = 16 << 20
    max_json_depth: int = 32  # nesting, checked on the raw bytes (http_guard.py)
    max_json_elements: int = 4_000_000  # values in one body, likewise
    # Bodies of at least parse_offload_bytes are scanned and parsed by parse_processes
    # parser processes, off the server's GIL (body_parse.py); paths other than submit and
    # episode take at most small_body_bytes (parsed on the event loop).
    parse_processes: int = 2
    parse_offload_bytes: int = 128 << 10
    parse_timeout_s: float = 120.0  # a parser silent this long is replaced, its body 503
    small_body_bytes: int = 1 << 20
    header_timeout_s: float = 10.0  # a request's headers must arrive within (http_bounds.py)
    max_connections_per_peer: int = 64  # open connections per client address (not loopback)
    advertise_host: str | None = None  # the host in the published url; default: the bind host
    allow_plain_http: bool = False  # serve non-loopback workers without TLS (unsafe on a WAN)
    relay_hosts: tuple[str, ...] = ()  # relay URL hosts kept as claimed (NAT names)
    # Addresses / CIDRs of the reverse proxies whose X-Forwarded-For / -Proto are believed;
    # empty: those headers are ignored from everyone.
    trusted_proxies: tuple[str, ...] = ()
    prometheus: bool = True  # GET /metrics (bridge/control/http/prometheus.py)
    metrics_token_file: str | None = None  # bearer for non-loopback scrapers; None: loopback only
    lean_routes: bool = True  # heartbeat and lease without FastAPI (fast_routes.py)


def _too_many(wait_s: float) -> tuple[int, dict, dict]:
    return (
        429,
        {"detail": "rate limited", "retry_after_s": round(wait_s, 3)},
        {"Retry-After": limits.retry_after_header(wait_s)},
    )


def make_app(
    controller: Controller,
    join_secret: str | JoinSecret,
    max_body_bytes: int = 16 << 20,
    *,
    allow_plain_http: bool = False,
    relay_hosts: tuple[str, ...] = (),
    max_json_depth: int = 32,
    max_json_elements: int = 4_000_000,
    lean: bool = True,
    parse_pool: ParsePool | None = None,
    small_body_bytes: int = 1 << 20,
) -> FastAPI:
    secret = join_secret if isinstance(join_secret, JoinSecret) else JoinSecret(join_secret)
    parser = parse_pool or ParsePool()
    relay = RelayFilter(relay_hosts)  # the relay URL a worker may advertise

    app = FastAPI(
        title="echo2 controller",
        version="1",
        description="Leases prompt groups to rollout workers; accepts version-tagged trajectories.",
        docs_url=None,
        redoc_url=None,
    )
    # The bearer scheme is declared in the schema (http_guard.with_schemas) and enforced by
    # the guard; as a per-request FastAPI dependency it cost ~8% of the CPU under load.
    auth: list = []

    loopback = functools.lru_cache(maxsize=4096)(is_loopback)  # ipaddress parsing: 5% CPU

    async def check(scope: dict, headers: dict):
        """The service's policy, before any body is read (bridge/control/http/http_guard.py)."""
        path, client = scope["path"], scope.get("client")
        ip = client[0] if client else ""
        plain = scope.get("scheme", "http") != "https"
        if plain and not allow_plain_http and path != "/openapi.json" and not loopback(ip):
            detail = (
                "plain HTTP from a non-loopback address: the announced store could be "
                "rewritten on the way; serve TLS (controller.tls_cert, controller.tls_key) "
                "or set controller.allow_plain_http"
            )
            return 403, {"detail": detail}, {}
        scheme, _, token = headers.get("authorization", "").partition(" ")
        token = token.strip() if scheme.lower() == "bearer" and token.strip() else None
        state = scope.setdefault("state", {})
        if path == "/v1/register":  # no token yet: limited per client IP
            if (wait := controller.limits.check(ip, path, registration=True)) > 0:
                return _too_many(wait)
        if path in OPERATOR_PATHS and scope["method"] == "GET" and token and secret.matches(token):
            state["worker_id"] = None
            if (wait := controller.limits.check(f"operator@{ip}", path)) > 0:
                return _too_many(wait)
        elif path not in PUBLIC_PATHS:
            # A read of committed rows on the loop's own connection (db.reader): no lock.
            worker = controller.authenticate(token) if token else None
            if worker is None:  # failures are rate limited per client IP, like registrations
                if (wait := controller.limits.check(ip, "unauthenticated", True)) > 0:
                    return _too_many(wait)
                detail = {"detail": "missing or invalid worker token"}
                return 401, detail, {"WWW-Authenticate": "Bearer"}
            state["worker_id"] = worker
            if (wait := controller.limits.check(worker, path)) > 0:
                return _too_many(wait)
        return None

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, e: RequestValidationError):
        # Without the echoed input: it may hold NaN (unencodable) or be megabytes long.
        errors = [{"loc": list(x["loc"]), "msg": x["msg"], "type": x["type"]} for x in e.errors()]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(SubmissionError)
    async def refused(request: Request, e: SubmissionError):
        if isinstance(e, OverBudget):  # waited out by ControllerClient, like a rate limit
            status, body, headers = _too_many(e.wait_s)
            return JSONResponse({**body, "detail": str(e)}, status_code=status, headers=headers)
        return JSONResponse({"detail": str(e)}, status_code=e.status)

    @app.post("/v1/register", response_model=RegisterResponse)
    def register(req: RegisterRequest, request: Request) -> RegisterResponse | JSONResponse:
        ip = request.client.host if request.client else None
        identity = identity_of(req.join_secret, secret.accepted(), ip)  # identity.py
        if identity is None:
            raise HTTPException(403, "wrong join secret")
        # One party's registrations, whatever addresses it comes from (limits.py).
        if identity != LOCAL and (wait := controller.limits.check_registrant(identity)) > 0:
            status, body, headers = _too_many(wait)
            return JSONResponse(body, status, headers)
        try:
            worker_id, token = controller.register(req.profile, identity)
        except SubmissionError as e:
            if e.status != 429:  # too many live workers: ask again when one may have gone
                raise
            status, body, headers = _too_many(controller.config.worker_timeout_s)
            return JSONResponse({**body, "detail": str(e)}, status, headers)
        c = controller.config
        return RegisterResponse(
            worker_id=worker_id,
            token=token,
            heartbeat_interval_s=controller.heartbeat_interval(),
            lease_ttl_s=c.lease_ttl_s,
            announcement=controller.announcement(),
        )

    # Heartbeat, lease and submit are answered by the guard's lean handlers (fast_routes.py);
    # their routes here declare them in the schema and answer when `lean` is off.
    @app.post("/v1/heartbeat", response_model=HeartbeatResponse, dependencies=auth)
    def heartbeat(hb: Heartbeat, request: Request) -> HeartbeatResponse:
        caller, worker = request.client.host if request.client else None, request.state.worker_id
        return controller.heartbeat(worker, relay(worker, hb, caller))

    @app.post("/v1/lease", response_model=LeaseResponse, dependencies=auth)
    def lease(req: LeaseRequest, request: Request) -> LeaseResponse:
        return controller.lease(request.state.worker_id, req)

    @app.post(
        "/v1/submit",
        response_model=SubmitResponse,
        dependencies=auth,
        openapi_extra={"requestBody": json_body("Submission")},
    )
    async def submit(request: Request) -> SubmitResponse:
        # The body (up to max_body_bytes) is parsed off the event loop, a large one in a
        # parser process (body_parse.py): it does not stall other workers' heartbeats.
        body = await request.body()
        return await run_in_threadpool(_submit, request.state.worker_id, body)

    def _submit(worker: str, body: bytes) -> SubmitResponse:
        try:
            sub = parser.submission(
                body,
                max_json_depth,
                max_json_elements,
                admit=functools.partial(controller.check_submission_lease, worker),
            )
        except BodyRefused as e:
            if e.status != 422:
                raise SubmissionError(e.detail, e.status) from None
            errors = [{**x, "loc": ("body", *x["loc"])} for x in e.detail]
            raise RequestValidationError(errors) from None
        del body
        # The submission is freed here, on this pool thread, in pieces (body_parse.py
        # `free_in_pieces`): a refusal's traceback would carry it to the event loop.
        trajectories = [t for g in sub.groups for t in g.trajectories]
        try:
            return controller.submit(worker, sub)
        except (SubmissionError, HTTPException) as e:
            refused = without_frames(e)
        finally:
            del sub
            free_in_pieces(trajectories)
        raise refused

    @app.post("/v1/episode", response_model=EpisodeStepResponse, dependencies=auth)
    def episode(req: EpisodeStep, request: Request) -> EpisodeStepResponse:
        return controller.episode_step(request.state.worker_id, req)

    @app.post("/v1/release", response_model=Ack, dependencies=auth)
    def release(rel: Release, request: Request) -> Ack:
        if log_safe(rel.lease_id) != rel.lease_id:  # not an id this controller issued
            raise SubmissionError(f"unknown lease {log_safe(rel.lease_id)!r}", 404)
        # The worker's own words reach the controller's log: escaped, one line.
        ok = controller.release(request.state.worker_id, rel.lease_id, log_safe(rel.reason, 1024))
        return Ack(ok=ok, detail="" if ok else "lease was no longer active")

    @app.post("/v1/leave", response_model=Ack, dependencies=auth)
    def leave(request: Request) -> Ack:
        controller.leave(request.state.worker_id)
        return Ack()

    @app.get("/v1/version", response_model=VersionAnnouncement, dependencies=auth)
    def version() -> VersionAnnouncement:
        return controller.announcement()

    @app.get("/v1/status", dependencies=auth)
    def status(request: Request) -> dict:
        # A worker sees the run and its own row; the operator (join secret) the whole fleet.
        return controller.status(only=request.state.worker_id)

    news = VersionNews(controller)  # held heartbeats (fast_routes.py)
    app.add_middleware(
        HttpGuard,
        check=check,
        max_body_bytes=max_body_bytes,
        max_json_depth=max_json_depth,
        max_json_elements=max_json_elements,
        fast=fast_routes(controller, relay, news, _submit) if lean else {},
        parse_pool=parser,
        parsed_in_route=frozenset({"/v1/submit"}),
        large_body_paths=frozenset({"/v1/submit", "/v1/episode"}),
        small_body_bytes=small_body_bytes,
    )
    app.state.parse_pool = parser
    app.state.version_news = news
    app.openapi = with_schemas(app, Submission, public=PUBLIC_PATHS)
    return app


class ControllerServer:
    """uvicorn serving `make_app(...)` on a daemon thread; `url` is known once started."""

    def __init__(
        self, controller: Controller, join_secret: str | JoinSecret, options: ServerOptions
    ):
        self.options = options
        self.app = make_app(
            controller,
            join_secret,
            options.max_body_bytes,
            allow_plain_http=options.allow_plain_http,
            relay_hosts=tuple(options.relay_hosts),
            max_json_depth=options.max_json_depth,
            max_json_elements=options.max_json_elements,
            lean=options.lean_routes,
            parse_pool=ParsePool(
                options.parse_processes, options.parse_offload_bytes, options.parse_timeout_s
            ),
            small_body_bytes=options.small_body_bytes,
        )
        if options.prometheus:
            prometheus.install(
                self.app,
                controller.status,
                token_file=options.metrics_token_file,
                allow_plain_http=options.allow_plain_http,
            )
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def start(self, timeout_s: float = 30.0) -> ControllerServer:
        o = self.options
        if bool(o.certfile) != bool(o.keyfile):
            raise ValueError("TLS needs both certfile and keyfile")
        # Bind here, so port 0 resolves before the thread starts and the url is exact.
        sock = socket.socket(socket.AF_INET6 if ":" in o.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((o.host, o.port))
        port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            ssl_certfile=o.certfile,
            ssl_keyfile=o.keyfile,
            http=bounded_protocol(o.header_timeout_s, o.max_connections_per_peer),
            # uvicorn trusts 127.0.0.1's forwarded headers unless told otherwise.
            proxy_headers=bool(o.trusted_proxies),
            forwarded_allow_ips=list(o.trusted_proxies) or "",
        )
        if not o.certfile and not o.allow_plain_http and not is_loopback(o.host):
            logging.warning(
                "controller on %s without TLS: non-loopback workers will be refused (403); "
                "set controller.tls_cert/tls_key, or controller.allow_plain_http",
                o.host,
            )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True, name="controller"
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"controller server failed to start on {o.host}:{port}")
            time.sleep(0.01)
        host = o.advertise_host or (socket.getfqdn() if o.host in ("0.0.0.0", "::") else o.host)
        if ":" in host:
            host = f"[{host}]"
        self.url = f"{'https' if o.certfile else 'http'}://{host}:{port}"
        return self

    def write_controller_json(self, workdir: str) -> str:
        path = os.path.join(workdir, "controller.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"url": self.url, "openapi": self.url + "/openapi.json"}, f)
        os.replace(tmp, path)  # readers never see a half-written file
        return path

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop serving. Requests in flight get up to `grace_s` to finish; idle keep-alive
        connections are not waited for: uvicorn waits for every connection to close, and
        an idle TLS one closes only when the client answers the close_notify, which an idle
        pooled client never reads (a joined worker session held the stop for 10 s)."""
        server, self._server = self._server, None
        if server is None:
            return
        self.app.state.parse_pool.close()
        self.app.state.version_news.release()  # held heartbeats answer now, not at their hold
        server.should_exit = True
        deadline = time.monotonic() + grace_s
        while self._thread.is_alive() and time.monotonic() < deadline:
            # Once uvicorn has closed its listeners it has also told every connection to
            # shut down, so no request starts after that: with none in flight, stop waiting.
            closed = not any(s.is_serving() for s in server.servers)
            if closed and not server.server_state.tasks:
                server.force_exit = True
            self._thread.join(timeout=0.05)
        server.force_exit = True
        self._thread.join(timeout=5)


def serve_controller(
    controller: Controller, workdir: str, options: ServerOptions, token_file: str | None = None
) -> ControllerServer:
    """Join secret (read or generated; re-read when its file changes, join_secret.py),
    server started, <workdir>/controller.json written."""
    load_or_create_join_secret(workdir, token_file)
    secret = JoinSecret.from_file(
        token_file or os.path.join(workdir, "join_token"),
        grace_s=controller.config.join_secret_grace_s,
    )
    server = ControllerServer(controller, secret, options)
    server.start()
    server.write_controller_json(workdir)
    # What is built by now (modules, the app, the tokenizer) lives as long as the process:
    # frozen, no full collection walks it again (each took ~110 ms, up to 0.4 s, ~20 a
    # minute at 500 workers, every thread stopped meanwhile).
    gc.freeze()
    return server
