"""Lean handlers for the hot endpoints, heartbeat, lease and submit, without FastAPI (issue 25).

Under load FastAPI's routing, dependency solving, request validation and response-model
serialization were most of the controller's ~1.9 ms of CPU per request (BUILD_NOTES.md,
issue 25 profile), and heartbeats and leases are most requests. After `HttpGuard` has done
the framing, the body limit, the JSON bounds and authentication (http_guard.py, the same
for every path), `/v1/heartbeat`, `/v1/lease` and `/v1/submit` are answered here: the body
is parsed and validated by pydantic-core straight from the bytes (`model_validate_json`, the
same models and rules), the controller answers, and pydantic-core writes the reply
(`to_json`). Field
names, status codes and error bodies are those of the FastAPI routes, which stay declared
in service.py for the OpenAPI schema (and answer if the guard is built without these).

A heartbeat that carries `news_after` is held on the loop until a newer version is announced
or for one heartbeat interval (version_news.py); the FastAPI route answers it at once.

Where each runs: a heartbeat on the event loop (hot state in memory, no lock, no SQLite:
hot_state.py), except when the activation solve is due (it takes the controller's lock),
then on a pool thread; a lease always on a thread of its own lane (lock, SQLite,
group-commit fsync); a submission, parse included, on a thread of the submissions' lane
(service.py's `_submit`). The lanes are asyncio executor hand-offs (`on_thread`), not
anyio's `to_thread.run_sync`, whose limiter, cancel scope and context lookups cost ~40-55 us
of CPU per call against ~14 us (a hop between the loop and a thread, both sides), 2-3 per
accepted submission.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import anyio
import pydantic
from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError

from bridge.broadcast.relay_address import advertised_relay_url
from bridge.control.http.version_news import VersionNews
from bridge.control.intake.validation import SubmissionError
from bridge.control.protocol import (
    Heartbeat,
    HeartbeatResponse,
    LeaseRequest,
    LeaseResponse,
    SubmitResponse,
)
from bridge.control.trust.log_text import log_safe

Route = Callable[[dict, bytes], Awaitable[tuple[int, bytes]]]

# Leases run on pool threads of their own, not anyio's shared 40: at 500 workers @ 2 s every
# shared thread could be a submission waiting for its scoring, the lock or its fsync, and a
# lease (one short transaction) queued ~100-300 ms for a thread.
LEASE_THREADS = 32
# Submissions wait for their scoring, the lock and their fsync: as many threads as anyio's
# default pool that they used before (its 40 then also served every FastAPI route).
SUBMIT_THREADS = 40


async def on_thread(lane: ThreadPoolExecutor, fn, *args):
    """`fn(*args)` on a thread of `lane`, awaited on the event loop (module doc)."""
    return await asyncio.get_running_loop().run_in_executor(lane, fn, *args)


class RelayFilter:
    """The relay URL a worker may advertise (bridge/broadcast/relay_address.py): a refused
    one is replaced by "" and logged once per worker and URL."""

    def __init__(self, relay_hosts: tuple[str, ...]):
        self.relay_hosts, self._refused = relay_hosts, set()

    def __call__(self, worker: str, hb: Heartbeat, caller: str | None) -> Heartbeat:
        url, why = advertised_relay_url(hb.relay_url, caller, self.relay_hosts)
        if not url and why and (worker, hb.relay_url) not in self._refused:
            if len(self._refused) < 10_000:  # once per worker and URL
                self._refused.add((worker, hb.relay_url))
            logging.warning(
                "worker %s: relay URL %s refused (%s); it relays to no one",
                worker,
                log_safe(hb.relay_url),
                log_safe(why),
            )
        return hb if url == hb.relay_url else hb.model_copy(update={"relay_url": url})


def _error(status: int, detail) -> tuple[int, bytes]:
    return status, json.dumps({"detail": detail}).encode()


def _malformed(e: pydantic.ValidationError) -> tuple[int, bytes]:
    """FastAPI's 422 as service.py shapes it (without the echoed input)."""
    errors = [{"loc": ["body", *x["loc"]], "msg": x["msg"], "type": x["type"]} for x in e.errors()]
    return _error(422, errors)


def fast_routes(
    controller, relay: RelayFilter, news: VersionNews | None = None, submit=None
) -> dict[str, Route]:
    """path -> handler(scope, body) -> (status, JSON bytes), for `HttpGuard(fast=...)`.
    `news`: where held heartbeats wait (a new one if None). `submit(worker, body)`:
    service.py's submission handler (parses on its pool thread)."""

    def answer(model, call, out):
        async def route(scope: dict, body: bytes) -> tuple[int, bytes]:
            worker = scope["state"]["worker_id"]
            client = scope.get("client")
            try:
                req = body if model is None else model.model_validate_json(body)
                reply = await call(worker, req, client[0] if client else None)
            except pydantic.ValidationError as e:
                return _malformed(e)
            except RequestValidationError as e:  # submit's parse, already shaped
                errors = [
                    {"loc": list(x["loc"]), "msg": x["msg"], "type": x["type"]} for x in e.errors()
                ]
                return _error(422, errors)
            except SubmissionError as e:
                return _error(e.status, str(e))
            except HTTPException as e:
                return _error(e.status_code, e.detail)
            return 200, out.__pydantic_serializer__.to_json(reply)

        return route

    news = news if news is not None else VersionNews(controller)

    async def heartbeat(worker, hb, caller):
        hb = relay(worker, hb, caller)
        if hb.news_after is not None and controller.config.news_hold:  # a partial rollout
            await news.hold(hb.news_after, controller.heartbeat_interval(worker))
        if controller.heartbeat_takes_lock():  # the activation solve is due: off the loop
            return await anyio.to_thread.run_sync(controller.heartbeat, worker, hb)
        return controller.heartbeat(worker, hb)

    # Threads start at first use; they end when the app (these closures) is collected.
    lease_lane = ThreadPoolExecutor(LEASE_THREADS, thread_name_prefix="lease")
    submit_lane = ThreadPoolExecutor(SUBMIT_THREADS, thread_name_prefix="submit")

    async def lease(worker, req, caller):
        return await on_thread(lease_lane, controller.lease, worker, req)

    async def submission(worker, body, caller):  # parsed off the loop: a big body stalls no one
        return await on_thread(submit_lane, submit, worker, body)

    routes = {
        "/v1/heartbeat": answer(Heartbeat, heartbeat, HeartbeatResponse),
        "/v1/lease": answer(LeaseRequest, lease, LeaseResponse),
    }
    if submit is not None:
        routes["/v1/submit"] = answer(None, submission, SubmitResponse)
    return routes
