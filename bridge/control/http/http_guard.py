"""The controller's HTTP front door: a pure ASGI middleware (issue 25; issue 23 item 10).

Every request passes here before FastAPI sees it. Pure ASGI rather than Starlette's
`BaseHTTPMiddleware`, whose per-request task and body stream cost a third of the
controller's CPU under load (BUILD_NOTES.md, issue 25 profile). In order:

1. **Framing.** `Content-Length` must be digits and at most `max_body_bytes` (413); a body
   without one (`Transfer-Encoding` in any letter case: `chunked`, `Chunked`, `gzip, chunked`)
   is refused (411). Independently of the headers, the body is read here, counting bytes as
   they arrive, and refused (413) the moment it passes the limit: no framing trick gets a
   larger body to the parser.
2. **JSON shape** (`json_bounds`), on the raw bytes before any parser builds objects: nesting
   at most `max_json_depth`, at most `max_json_elements` values, and at most one container
   (`[`, `{`) per `BYTES_PER_CONTAINER` bytes (413): what a parse may cost in memory is then
   proportional to the body (a container is ~64 bytes of Python objects, a value at most
   ~36; a body of nested empty arrays, 3 bytes per container, cost 35x its size). A large
   body is scanned in a parser process (bridge/control/http/body_parse.py), or by its route's
   own parse there (`parsed_in_route`, /v1/submit); a path outside `large_body_paths` takes
   at most `small_body_bytes` (its handler parses on the event loop).
3. `check(scope, headers)`, the service's policy (plain HTTP, rate limits, the bearer token):
   an early reply, or None to go on (it may put `worker_id` in `scope["state"]`).

The buffered body is then replayed to the app, or, for a path in `fast` (POST), handed to
its lean handler (bridge/control/http/fast_routes.py: heartbeat, lease), whose JSON bytes are
the reply. All replies here are small JSON documents.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable

import anyio

# Strings are removed before counting structure (brackets and commas inside a string are
# text): escaped backslashes and quotes go first, then every byte but " [ ] { } , (C speed,
# bytes.translate), then the now short strings. A 16 MiB body costs milliseconds.
_STRING = re.compile(rb'"[^"]*"')
_INNERMOST = re.compile(rb"\[[^\[\]{}]*\]|\{[^\[\]{}]*\}")
_NOT_STRUCTURE = bytes(range(256)).translate(None, b'"[]{},')
_ON_LOOP_BYTES = 1 << 16  # bodies up to this are scanned on the event loop (microseconds)
# An honest body has far fewer containers: a trajectory is ~6 in >= 100 bytes of its keys.
BYTES_PER_CONTAINER = 8
_FREE_CONTAINERS = 64  # however short the body


def json_bounds(body: bytes, max_depth: int, max_elements: int) -> tuple[int, str] | None:
    """(status, why) if `body` nests deeper than `max_depth` or holds more than
    `max_elements` values (an upper bound: commas + 1 + containers), else None. Malformed
    JSON (brackets that do not balance) is left to the parser's 422."""
    quotes = body.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    structure = _STRING.sub(b"", quotes)  # only [ ] { } , remain
    containers = structure.count(b"[") + structure.count(b"{")
    elements = structure.count(b",") + 1 + containers
    if elements > max_elements:
        return 413, f"JSON of more than {max_elements} elements"
    if containers > (most := len(body) // BYTES_PER_CONTAINER + _FREE_CONTAINERS):
        return 413, f"JSON of more than {most} containers ({BYTES_PER_CONTAINER} bytes each)"
    brackets = structure.replace(b",", b"")
    # Each pass removes the innermost pairs: a body of depth d is empty after d passes.
    for _ in range(max_depth):
        if not brackets:
            return None
        brackets, removed = _INNERMOST.subn(b"", brackets)
        if not removed:  # unbalanced: malformed, the parser's 422 says so
            return None
    if not brackets:
        return None
    return 413, f"JSON nested deeper than {max_depth}"


Reply = tuple[int, dict, dict]  # status, JSON body, extra headers
Check = Callable[[dict, dict], Awaitable[Reply | None]]


async def send_json(send, status: int, body: dict | bytes, headers: dict | None = None) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.lower().encode(), str(v).encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


class HttpGuard:
    """ASGI middleware: framing, body limit, JSON bounds, then `check` (see module doc)."""

    def __init__(
        self,
        app,
        check: Check,
        max_body_bytes: int,
        max_json_depth: int = 32,
        max_json_elements: int = 4_000_000,
        fast: dict | None = None,
        *,
        parse_pool=None,
        parsed_in_route: frozenset = frozenset(),
        large_body_paths: frozenset | None = None,
        small_body_bytes: int = 1 << 20,
    ):
        self.app, self.check, self.fast = app, check, fast or {}
        self.max_body_bytes, self.max_depth = max_body_bytes, max_json_depth
        self.max_elements = max_json_elements
        self.pool, self.parsed_in_route = parse_pool, parsed_in_route
        self.large_body_paths, self.small_body_bytes = large_body_paths, small_body_bytes

    def _limit(self, path: str) -> int:
        if self.large_body_paths is None or path in self.large_body_paths:
            return self.max_body_bytes
        return min(self.max_body_bytes, self.small_body_bytes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        length = headers.get("content-length")
        if length is None and "transfer-encoding" in headers:
            return await send_json(send, 411, {"detail": "Content-Length required"})
        limit = self._limit(scope["path"])
        if length is not None:
            if not length.isdigit():
                return await send_json(send, 400, {"detail": "bad Content-Length"})
            if int(length) > limit:
                detail = f"body of {length} bytes exceeds {limit}"
                return await send_json(send, 413, {"detail": detail})
        reply = await self.check(scope, headers)
        if reply is not None:
            return await send_json(send, *reply)
        body, more = [], True
        size = 0
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                detail = f"body exceeds {limit} bytes"
                return await send_json(send, 413, {"detail": detail})
            body.append(chunk)
            more = message.get("more_body", False)
        data = b"".join(body)
        bounds = (data, self.max_depth, self.max_elements)
        if self.pool is not None and self.pool.large(data):  # off this process's GIL
            in_route = scope["path"] in self.parsed_in_route
            bad = None if in_route else await anyio.to_thread.run_sync(self.pool.bounds, *bounds)
        elif len(data) > _ON_LOOP_BYTES:  # a big body is scanned on a pool thread
            bad = await anyio.to_thread.run_sync(json_bounds, *bounds)
        else:
            bad = json_bounds(*bounds) if data else None
        if bad:
            return await send_json(send, bad[0], {"detail": bad[1]})
        if (route := self.fast.get(scope["path"])) is not None and scope["method"] == "POST":
            return await send_json(send, *await route(scope, data))
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": data, "more_body": False}
            return await receive()  # after the body: wait for the disconnect

        return await self.app(scope, replay, send)


def json_body(model: str) -> dict:
    ref = {"$ref": f"#/components/schemas/{model}"}
    return {"required": True, "content": {"application/json": {"schema": ref}}}


def with_schemas(app, *models, public: frozenset = frozenset()):
    """`app.openapi`, plus the schemas of bodies an endpoint parses itself (submit: off
    the event loop), which FastAPI would otherwise leave out of /openapi.json, and the
    bearer scheme on every path but `public` (enforced here, in `HttpGuard`'s check)."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            schemes = schema.setdefault("components", {}).setdefault("securitySchemes", {})
            schemes["HTTPBearer"] = {"type": "http", "scheme": "bearer"}
            for path, ops in schema.get("paths", {}).items():
                for op in ops.values() if path not in public else ():
                    op["security"] = [{"HTTPBearer": []}]
            comps = schema["components"].setdefault("schemas", {})
            for m in models:
                js = m.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(js.pop("$defs", {}))
                comps[m.__name__] = js
        return app.openapi_schema

    return openapi
