"""The relay URL peers should use for a worker, from what it claims and where it called from.

A worker started without `--relay_url` advertises `http://127.0.0.1:PORT`, which is right
only when every worker shares one machine. When such a loopback URL arrives over a
non-loopback connection, the worker is remote and its children would dial their own
loopback: the controller substitutes the address the heartbeat came from (the port kept).
Behind NAT that is the NAT's address and the port may be closed; children then fall back
to the store after `connection refused`, which costs a round trip, not a stall. An
explicit non-loopback URL is never changed (the worker knows its public name best).
"""

from __future__ import annotations

import ipaddress
import urllib.parse


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def reachable_relay_url(claimed: str, caller_host: str | None) -> str:
    """`claimed` with its host replaced by `caller_host` when only the former is loopback."""
    if not claimed or not caller_host or _is_loopback(caller_host):
        return claimed
    url = urllib.parse.urlsplit(claimed)
    if not _is_loopback(url.hostname):
        return claimed
    host = f"[{caller_host}]" if ":" in caller_host else caller_host
    netloc = f"{host}:{url.port}" if url.port else host
    return urllib.parse.urlunsplit(url._replace(netloc=netloc))
