"""The relay URL peers are told to use for a worker: never more than the address it called
from (issue 23 item 4).

A worker advertises its relay in every heartbeat, and the controller hands that URL to other
workers as their parent or fallback, so an advertised URL is an instruction to the rest of
the fleet. Taken as given it would be a way in: `file:///...` or `s3://...` would be read by
the children as a weight store with their own credentials, and `http://10.0.0.4:9` or
`http://169.254.169.254/` would make them dial services on the controller's network. So:

- only `http` or `https`, with a bare base URL (no user info, path, query or fragment) and a
  valid port; anything else is refused (the worker stays a leaf: it receives, never relays);
- the host is always the address the worker's request came from (the claimed port kept):
  a worker may only point peers at itself. This also routes a remote worker that advertises
  the default `http://127.0.0.1:PORT` to where it really is. Behind NAT the caller's
  address is the NAT's, which is where a forwarded port lives;
- unless the claimed host is on the operator's allow-list (`allow_hosts`, exact names or IP
  addresses, e.g. a NAT's public DNS name or a load balancer): then it is kept.

A request whose caller address is unknown or not an IP (a Unix socket, a test client) keeps
only a loopback URL. Peers dial the result with the relay protocol only: a relay URL is
never treated as a store (`rollout_gpu/peer_fetch.py` reads `http(s)` sources as relays).
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from collections.abc import Iterable

SCHEMES = ("http", "https")


def _ip(host: str | None):
    try:
        return ipaddress.ip_address((host or "").strip("[]"))
    except ValueError:
        return None


def is_loopback(host: str | None) -> bool:
    if host == "localhost":
        return True
    ip = _ip(host)
    return ip is not None and ip.is_loopback


def advertised_relay_url(
    claimed: str, caller_host: str | None, allow_hosts: Iterable[str] = ()
) -> tuple[str, str]:
    """(the URL peers may use, '' = none; why it differs from `claimed`, '' = it does not)."""
    if not claimed:
        return "", ""
    try:
        url = urllib.parse.urlsplit(claimed)
        port = url.port
    except ValueError as e:
        return "", f"unparsable relay URL ({e})"
    if url.scheme.lower() not in SCHEMES:
        return "", f"scheme {url.scheme!r} is not http(s)"
    if url.username is not None or url.password is not None:
        return "", "user info in a relay URL"
    if url.path not in ("", "/") or url.query or url.fragment:
        return "", "a relay URL is a bare base URL (no path, query or fragment)"
    host = (url.hostname or "").lower()
    if not host:
        return "", "no host"
    allowed = {h.lower().strip("[]") for h in allow_hosts}
    caller_ip, why = _ip(caller_host), ""
    if host.strip("[]") in allowed:
        pass
    elif caller_ip is None:
        if not is_loopback(host):
            return "", "the caller's address is unknown and the URL is not loopback"
    elif _ip(host) != caller_ip:
        host, why = str(caller_ip), "host replaced by the caller's address"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{url.scheme.lower()}://{host}" + (f":{port}" if port is not None else ""), why


def reachable_relay_url(claimed: str, caller_host: str | None, allow_hosts=()) -> str:
    """`advertised_relay_url`'s URL alone ('' = refused)."""
    return advertised_relay_url(claimed, caller_host, allow_hosts)[0]
