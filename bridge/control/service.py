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
body over `max_body_bytes` (411 when a body has no Content-Length). GET /v1/status
(read-only) also takes the join secret as bearer, for `python -m bridge.status`. For WAN use pass
`certfile`/`keyfile` and the server speaks HTTPS. Abuse limits (bridge/control/limits.py):
429 + Retry-After past a per-worker (per client IP for /v1/register) request rate, checked
before any body is parsed. The join secret is re-read when its file changes, the old one
accepted for a grace period (bridge/control/join_secret.py). The schema is public at /openapi.json;
the interactive docs pages are off (they would be unauthenticated endpoints).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, HTTPException, Request, Security
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPBearer

from bridge.broadcast.relay_address import reachable_relay_url
from bridge.control import limits
from bridge.control.controller import Controller
from bridge.control.join_secret import JoinSecret
from bridge.control.protocol import (
    Ack,
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
from bridge.control.validation import SubmissionError

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
    advertise_host: str | None = None  # the host in the published url; default: the bind host


def load_or_create_join_secret(workdir: str, token_file: str | None = None) -> str:
    """The join secret from `token_file`, else from (or generated into) <workdir>/join_token."""
    if token_file:
        with open(token_file) as f:
            secret = f.read().strip()
        if not secret:
            raise ValueError(f"join secret file {token_file} is empty")
        return secret
    path = os.path.join(workdir, "join_token")
    os.makedirs(workdir, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return load_or_create_join_secret(workdir, path)
    secret = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _too_many(wait_s: float) -> JSONResponse:
    return JSONResponse(
        {"detail": "rate limited", "retry_after_s": round(wait_s, 3)},
        status_code=429,
        headers={"Retry-After": limits.retry_after_header(wait_s)},
    )


def make_app(
    controller: Controller, join_secret: str | JoinSecret, max_body_bytes: int = 16 << 20
) -> FastAPI:
    secret = join_secret if isinstance(join_secret, JoinSecret) else JoinSecret(join_secret)

    def _is_secret(request: Request) -> bool:
        token = _bearer(request)
        return token is not None and secret.matches(token)

    app = FastAPI(
        title="echo2 controller",
        version="1",
        description="Leases prompt groups to rollout workers; accepts version-tagged trajectories.",
        docs_url=None,
        redoc_url=None,
    )
    # Declares the scheme in the schema; the middleware below does the enforcement.
    auth = [Security(HTTPBearer(auto_error=False))]

    @app.middleware("http")
    async def guard(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is None and "chunked" in request.headers.get("transfer-encoding", ""):
            return JSONResponse({"detail": "Content-Length required"}, status_code=411)
        if length is not None:
            if not length.isdigit():
                return JSONResponse({"detail": "bad Content-Length"}, status_code=400)
            if int(length) > max_body_bytes:
                return JSONResponse(
                    {"detail": f"body of {length} bytes exceeds {max_body_bytes}"},
                    status_code=413,
                )
        path, ip = request.url.path, request.client.host if request.client else ""
        if path == "/v1/register":  # no token yet: limited per client IP
            if (wait := controller.limits.check(ip, path, registration=True)) > 0:
                return _too_many(wait)
        if path in OPERATOR_PATHS and request.method == "GET" and _is_secret(request):
            request.state.worker_id = None
            if (wait := controller.limits.check(f"operator@{ip}", path)) > 0:
                return _too_many(wait)
        elif path not in PUBLIC_PATHS:
            token = _bearer(request)
            worker = await run_in_threadpool(controller.authenticate, token) if token else None
            if worker is None:
                return JSONResponse(
                    {"detail": "missing or invalid worker token"},
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
            request.state.worker_id = worker
            if (wait := controller.limits.check(worker, path)) > 0:
                return _too_many(wait)
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, e: RequestValidationError):
        # Without the echoed input: it may hold NaN (unencodable) or be megabytes long.
        errors = [{"loc": list(x["loc"]), "msg": x["msg"], "type": x["type"]} for x in e.errors()]
        return JSONResponse({"detail": errors}, status_code=422)

    @app.exception_handler(SubmissionError)
    async def refused(request: Request, e: SubmissionError):
        return JSONResponse({"detail": str(e)}, status_code=e.status)

    @app.post("/v1/register", response_model=RegisterResponse)
    def register(req: RegisterRequest) -> RegisterResponse:
        if not secret.matches(req.join_secret):
            raise HTTPException(403, "wrong join secret")
        worker_id, token = controller.register(req.profile)
        c = controller.config
        return RegisterResponse(
            worker_id=worker_id,
            token=token,
            heartbeat_interval_s=c.heartbeat_interval_s,
            lease_ttl_s=c.lease_ttl_s,
            announcement=controller.announcement(),
        )

    @app.post("/v1/heartbeat", response_model=HeartbeatResponse, dependencies=auth)
    def heartbeat(hb: Heartbeat, request: Request) -> HeartbeatResponse:
        caller = request.client.host if request.client else None
        url = reachable_relay_url(hb.relay_url, caller)
        if url != hb.relay_url:
            hb = hb.model_copy(update={"relay_url": url})
        return controller.heartbeat(request.state.worker_id, hb)

    @app.post("/v1/lease", response_model=LeaseResponse, dependencies=auth)
    def lease(req: LeaseRequest, request: Request) -> LeaseResponse:
        return controller.lease(request.state.worker_id, req)

    @app.post("/v1/submit", response_model=SubmitResponse, dependencies=auth)
    def submit(sub: Submission, request: Request) -> SubmitResponse:
        return controller.submit(request.state.worker_id, sub)

    @app.post("/v1/release", response_model=Ack, dependencies=auth)
    def release(rel: Release, request: Request) -> Ack:
        ok = controller.release(request.state.worker_id, rel.lease_id, rel.reason)
        return Ack(ok=ok, detail="" if ok else "lease was no longer active")

    @app.post("/v1/leave", response_model=Ack, dependencies=auth)
    def leave(request: Request) -> Ack:
        controller.leave(request.state.worker_id)
        return Ack()

    @app.get("/v1/version", response_model=VersionAnnouncement, dependencies=auth)
    def version() -> VersionAnnouncement:
        return controller.announcement()

    @app.get("/v1/status", dependencies=auth)
    def status() -> dict:
        return controller.status()

    return app


class ControllerServer:
    """uvicorn serving `make_app(...)` on a daemon thread; `url` is known once started."""

    def __init__(
        self, controller: Controller, join_secret: str | JoinSecret, options: ServerOptions
    ):
        self.options = options
        self.app = make_app(controller, join_secret, options.max_body_bytes)
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

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None


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
    return server
