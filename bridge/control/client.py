"""Typed HTTP client of the controller, for rollout workers (and tests): protocol models in,
protocol models out, one method per endpoint.

    client = ControllerClient.join(url, join_secret, WorkerProfile(...))
    r = client.lease(LeaseRequest(worker_version=v, max_groups=4))
    if r.swap_to is not None: ...swap weights to r.announcement...
    client.submit(Submission(lease_id=r.lease.lease_id, groups=[...]))

A refused request raises `ControllerError` with the status and the controller's message.
httpx is imported lazily so `bridge` stays importable without it.
"""

from __future__ import annotations

from typing import Any

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
    WorkerProfile,
)


class ControllerError(RuntimeError):
    def __init__(self, status: int, detail: Any):
        super().__init__(f"controller answered {status}: {detail}")
        self.status, self.detail = status, detail


class ControllerClient:
    def __init__(self, url: str, token: str, verify: Any = True, timeout_s: float = 60.0):
        import httpx

        self.token = token
        self._http = httpx.Client(
            base_url=url,
            headers={"Authorization": f"Bearer {token}"},
            verify=verify,
            timeout=timeout_s,
        )

    @classmethod
    def join(
        cls, url: str, join_secret: str, profile: WorkerProfile, verify: Any = True
    ) -> tuple[ControllerClient, RegisterResponse]:
        import httpx

        body = RegisterRequest(join_secret=join_secret, profile=profile).model_dump()
        r = httpx.post(url.rstrip("/") + "/v1/register", json=body, verify=verify, timeout=60)
        reg = RegisterResponse.model_validate(_ok(r))
        return cls(url, reg.token, verify), reg

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, model: Any | None = None) -> Any:
        # model_dump_json keeps the wire exactly what pydantic would accept back.
        content = model.model_dump_json() if model is not None else None
        r = self._http.post(path, content=content, headers={"Content-Type": "application/json"})
        return _ok(r)

    def heartbeat(self, hb: Heartbeat) -> HeartbeatResponse:
        return HeartbeatResponse.model_validate(self._post("/v1/heartbeat", hb))

    def lease(self, req: LeaseRequest) -> LeaseResponse:
        return LeaseResponse.model_validate(self._post("/v1/lease", req))

    def submit(self, sub: Submission) -> SubmitResponse:
        return SubmitResponse.model_validate(self._post("/v1/submit", sub))

    def release(self, lease_id: str, reason: str = "") -> Ack:
        return Ack.model_validate(
            self._post("/v1/release", Release(lease_id=lease_id, reason=reason))
        )

    def leave(self) -> Ack:
        return Ack.model_validate(self._post("/v1/leave"))

    def version(self) -> VersionAnnouncement:
        return VersionAnnouncement.model_validate(_ok(self._http.get("/v1/version")))

    def status(self) -> dict:
        return _ok(self._http.get("/v1/status"))


def _ok(r) -> Any:
    if r.status_code >= 400:
        try:
            detail = r.json().get("detail", r.text)
        except ValueError:
            detail = r.text
        raise ControllerError(r.status_code, detail)
    return r.json()
