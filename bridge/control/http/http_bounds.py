"""Connection-level bounds of the controller's HTTP server (issue 23 item 10).

What the ASGI guard (http_guard.py) cannot see, because it runs only once a request's
headers have arrived:

- **Header timeout.** A connection must deliver each request's complete headers within
  `header_timeout_s` of opening (or of the request's first byte on a kept-alive
  connection), else it is closed: a client trickling one header byte a second (slowloris)
  cannot hold a connection and its buffers. Bodies are bounded by size in the guard and
  by uvicorn's own flow control.
- **Connections per peer.** At most `max_per_peer` open connections per client address;
  one more is closed at once, before any byte is read. An honest worker holds a handful
  (heartbeat thread, lease/submit loop, relay reports); the load bench's simulated fleet
  shares 127.0.0.1, so loopback is exempt (the operator's own machine).

A subclass of uvicorn's httptools protocol, built per server by `bounded_protocol`, so
two servers in one process do not share counts.
"""

from __future__ import annotations

import collections

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from bridge.broadcast.relay_address import is_loopback


def bounded_protocol(
    header_timeout_s: float = 10.0, max_per_peer: int = 64, exempt_loopback: bool = True
) -> type:
    """An uvicorn `http=` protocol class with the bounds above (<= 0: that bound off)."""
    open_by_peer: collections.Counter[str] = collections.Counter()

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        _peer: str | None = None
        _header_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            peer = self.client[0] if self.client else ""
            if max_per_peer > 0 and not (exempt_loopback and is_loopback(peer)):
                if open_by_peer[peer] >= max_per_peer:
                    transport.close()  # connection_lost follows; nothing was counted
                    return
                open_by_peer[peer] += 1
                self._peer = peer
            self._arm_header_timer()

        def _arm_header_timer(self) -> None:
            if header_timeout_s > 0 and self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout_s, self._too_slow)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _too_slow(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm_header_timer()  # the next request on a kept-alive connection

        def on_headers_complete(self) -> None:
            self._disarm_header_timer()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm_header_timer()
            if self._peer is not None:
                open_by_peer[self._peer] -= 1
                if open_by_peer[self._peer] <= 0:
                    del open_by_peer[self._peer]
                self._peer = None
            super().connection_lost(exc)

    BoundedHttpToolsProtocol.open_by_peer = open_by_peer  # for tests and status
    return BoundedHttpToolsProtocol
