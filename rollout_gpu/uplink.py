"""A relay's upload: a token bucket shared by every response of one relay (one event loop),
so a benchmark or a test can give a relay the uplink of a real link; per-reader slots
(`Uplink`), and `send`, each response in its reader's turn, within time limits."""

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


class Uplink:
    """One relay's upload: bounded per-reader slots, FIFO within a reader, fair across them.

    A reader is a peer address. At most `max_readers` of them, and `per_reader` requests of
    each, are in flight at once (`admit`; past that the relay answers 429). One reader's
    responses go out one at a time, in order: sharing a child's uplink share among its k
    outstanding requests would make each chunk arrive k times later, and the chain's
    per-hop delay is that arrival time. Across readers nothing is held while a reader
    reads: the token bucket (if any) is taken piece by piece in turn (a FIFO lock), and a
    piece that a reader has not taken within `read_stall_s` cuts that reader's connection.
    So a reader that stops reading costs the others nothing and loses its slot within
    `read_stall_s` of its socket buffers filling."""

    def __init__(self, bucket: TokenBucket | None = None, max_readers: int = 32,
                 per_reader: int = 8, read_stall_s: float = 5.0):  # fmt: skip
        self.bucket, self.read_stall_s = bucket, read_stall_s
        self.max_readers, self.per_reader = max_readers, per_reader
        self.turn = asyncio.Lock()  # the bucket's tokens: one piece per turn, FIFO
        self.readers: dict[str, tuple[list, asyncio.Lock]] = {}  # address -> ([n], lock)
        self.sending, self.since = 0, 0.0  # responses being sent; busy time counted up to

    def busy(self, start: bool) -> float:
        """A response starts (True) or ends sending; the wall time the uplink was busy
        (some response sending) since the last call. Concurrent responses share the
        uplink, so summing each one's own duration would count the same second twice."""
        now = time.monotonic()
        seconds = now - self.since if self.sending else 0.0
        self.since, self.sending = now, self.sending + (1 if start else -1)
        return seconds

    def admit(self, reader: str) -> bool:
        """Take a slot for one request of `reader`; False: none free (429)."""
        entry = self.readers.get(reader)
        if entry is None:
            if len(self.readers) >= self.max_readers:
                return False
            entry = self.readers[reader] = ([0], asyncio.Lock())
        if entry[0][0] >= self.per_reader:
            return False
        entry[0][0] += 1
        return True

    def release(self, reader: str) -> None:
        count, _ = self.readers[reader]
        count[0] -= 1
        if not count[0]:
            del self.readers[reader]


async def send(
    request: web.Request,
    body: bytes,
    uplink: Uplink,
    max_send_s: float,
    tally: Callable[[int, float], None],
) -> web.StreamResponse:
    """`body` as the response to an `admit`ted request, in its reader's turn (`Uplink`);
    `tally(bytes, busy seconds)` after (`Uplink.busy`). Past `max_send_s` (plus the
    bucket's own pacing of `body`) in all, or `uplink.read_stall_s` on one piece, the
    connection is aborted."""
    bucket = uplink.bucket
    limit = max_send_s + (len(body) / bucket.rate if bucket is not None else 0.0)
    _, mine = uplink.readers[request.remote or ""]
    async with mine:
        resp = web.StreamResponse(headers={"Content-Length": str(len(body))})
        await resp.prepare(request)
        view, sent, busy = memoryview(body), 0, uplink.busy(True)
        try:
            async with asyncio.timeout(limit):
                for i in range(0, len(body), PIECE):
                    piece = view[i : i + PIECE]
                    if bucket is not None:
                        async with uplink.turn:
                            await bucket.take(len(piece))
                    async with asyncio.timeout(uplink.read_stall_s):
                        await resp.write(piece)
                    sent += len(piece)
                async with asyncio.timeout(uplink.read_stall_s):
                    await resp.write_eof()
        except TimeoutError:
            if request.transport is not None:
                request.transport.abort()
            raise
        finally:
            tally(sent, busy + uplink.busy(False))
    return resp
