"""Typed HTTP client of the controller, for rollout workers (and tests): protocol models in,
protocol models out, one method per endpoint.

    client = ControllerClient.join(url, join_secret, WorkerProfile(...))
    r = client.lease(LeaseRequest(worker_version=v, max_groups=4))
    if r.swap_to is not None: ...swap weights to r.announcement...
    client.submit(Submission(lease_id=r.lease.lease_id, groups=[...]))

A refused request raises `ControllerError` with the status and the controller's message.
A 429 (rate limited, bridge/control/trust/limits.py) is waited out and retried, up to
`max_rate_wait_s` in all per call. `verify`: True, False, an `ssl.SSLContext` or the path
of a CA bundle (a self-signed controller's certificate: the worker's `--tls_ca_file`).
httpx is imported lazily so `bridge` stays importable without it.
"""

from __future__ import annotations

import ssl
import time
from typing import Any

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
    WorkerProfile,
)


class ControllerError(RuntimeError):
    def __init__(self, status: int, detail: Any):
        super().__init__(f"controller answered {status}: {detail}")
        self.status, self.detail = status, detail


class ControllerClient:
    def __init__(
        self,
        url: str,
        token: str,
        verify: Any = True,
        timeout_s: float = 60.0,
        max_rate_wait_s: float = 120.0,
    ):
        import httpx

        self.token, self.max_rate_wait_s = token, max_rate_wait_s
        self._http = httpx.Client(
            base_url=url,
            headers={"Authorization": f"Bearer {token}"},
            verify=tls_verify(verify),
            timeout=timeout_s,
        )

    @classmethod
    def join(
        cls, url: str, join_secret: str, profile: WorkerProfile, verify: Any = True
    ) -> tuple[ControllerClient, RegisterResponse]:
        import httpx

        body = RegisterRequest(join_secret=join_secret, profile=profile).model_dump()
        register = url.rstrip("/") + "/v1/register"
        verify = tls_verify(verify)
        reg = RegisterResponse.model_validate(
            _ok(_paced(lambda: httpx.post(register, json=body, verify=verify, timeout=60)))
        )
        return cls(url, reg.token, verify), reg

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, model: Any | None = None) -> Any:
        # model_dump_json keeps the wire exactly what pydantic would accept back.
        content = model.model_dump_json() if model is not None else None
        headers = {"Content-Type": "application/json"}
        return _ok(
            _paced(
                lambda: self._http.post(path, content=content, headers=headers),
                self.max_rate_wait_s,
            )
        )

    def heartbeat(self, hb: Heartbeat) -> HeartbeatResponse:
        return HeartbeatResponse.model_validate(self._post("/v1/heartbeat", hb))

    def lease(self, req: LeaseRequest) -> LeaseResponse:
        return LeaseResponse.model_validate(self._post("/v1/lease", req))

    def submit(self, sub: Submission) -> SubmitResponse:
        return SubmitResponse.model_validate(self._post("/v1/submit", sub))

    def episode(self, step: EpisodeStep) -> EpisodeStepResponse:
        """The next observation of each live episode of a lease (POST /v1/episode)."""
        return EpisodeStepResponse.model_validate(self._post("/v1/episode", step))

    def release(self, lease_id: str, reason: str = "") -> Ack:
        return Ack.model_validate(
            self._post("/v1/release", Release(lease_id=lease_id, reason=reason))
        )

    def leave(self) -> Ack:
        return Ack.model_validate(self._post("/v1/leave"))

    def version(self) -> VersionAnnouncement:
        return VersionAnnouncement.model_validate(
            _ok(_paced(lambda: self._http.get("/v1/version"), self.max_rate_wait_s))
        )

    def status(self) -> dict:
        return _ok(_paced(lambda: self._http.get("/v1/status"), self.max_rate_wait_s))


def tls_verify(verify: Any) -> Any:
    """httpx's `verify` from ours: a CA bundle path becomes an SSL context (httpx
    deprecates paths)."""
    if isinstance(verify, str):
        return ssl.create_default_context(cafile=verify)
    return verify


def _paced(send, max_wait_s: float = 120.0):
    """`send()`, again after the controller's Retry-After while it answers 429 (the request
    was not processed, so a retry is safe even for a submission)."""
    waited = 0.0
    while True:
        r = send()
        if r.status_code != 429 or waited >= max_wait_s:
            return r
        try:
            wait = float(r.json()["retry_after_s"])
        except (ValueError, KeyError, TypeError):
            wait = float(r.headers.get("retry-after", "1"))
        wait = min(max(wait, 0.01), max_wait_s - waited)
        time.sleep(wait)
        waited += wait


def _ok(r) -> Any:
    if r.status_code >= 400:
        try:
            detail = r.json().get("detail", r.text)
        except ValueError:
            detail = r.text
        raise ControllerError(r.status_code, detail)
    return r.json()
