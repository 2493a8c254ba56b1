"""A relay's upload limit: a token bucket shared by every response of one relay (one event
loop), so a benchmark or a test can give a relay the uplink of a real link; and `send`, one
response at a time through it, each within a time limit."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from aiohttp import web

PIECE = 256 << 10  # bytes per token-bucket take and write: smaller costs CPU per byte


class TokenBucket:
    """Upload rate limit shared by every response of one relay (one event loop)."""

    def __init__(self, rate: float, burst: float = 4 * PIECE):
        self.rate, self.burst = rate, burst
        self.tokens, self.t = burst, time.monotonic()

    async def take(self, n: int) -> None:
        while True:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
            self.t = now
            if self.tokens >= n:
                self.tokens -= n
                return
            await asyncio.sleep((n - self.tokens) / self.rate)


async def send(
    request: web.Request,
    body: bytes,
    lock: asyncio.Lock,
    bucket: TokenBucket | None,
    max_send_s: float,
    tally: Callable[[int, float], None],
) -> web.StreamResponse:
    """`body` as the response, sent while holding `lock`; `tally(bytes, seconds)` after.

    One response at a time has the whole uplink (FIFO): sharing it among a child's k
    outstanding requests would make each chunk arrive k times later, and the chain's per-hop
    delay is that arrival time. So a reader that is slow or does not read at all must not
    keep it: past `max_send_s` (plus the bucket's own pacing of `body`) the connection is
    aborted and the lock passes on (issue 23 item 3)."""
    resp = web.StreamResponse(headers={"Content-Length": str(len(body))})
    await resp.prepare(request)
    limit = max_send_s + (len(body) / bucket.rate if bucket is not None else 0.0)
    async with lock:
        t0, view, sent = time.monotonic(), memoryview(body), 0
        try:
            async with asyncio.timeout(limit):
                for i in range(0, len(body), PIECE):
                    piece = view[i : i + PIECE]
                    if bucket is not None:
                        await bucket.take(len(piece))
                    await resp.write(piece)
                    sent += len(piece)
                await resp.write_eof()
        except TimeoutError:
            if request.transport is not None:
                request.transport.abort()
            raise
        finally:
            tally(sent, time.monotonic() - t0)
    return resp
