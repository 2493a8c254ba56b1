"""Every parameter a relay's HTTP endpoints take, checked before it is used (issue 23 item 3).

A relay (rollout_gpu/relay.py) answers any peer on its port. A parameter that reaches the
event loop unchecked can wedge it for everyone: `wait=nan` made `deadline - now` NaN, a
timer NaN seconds away, and a `version` of `1e400` or `"x"` raised in a handler. So each
value is parsed here into its range or refused with `BadParam` (the relay answers 400 and
changes nothing):

- `wait` (GET /kv/{key}?wait=S): a finite number of seconds in [0, max_wait_s];
- `key`: a weight-store key as the layout writes them: at most `MAX_KEY` printable ASCII
  characters, no empty, '.' or '..' segment, no leading '/' or backslash;
- POST /fetch and /forget bodies (standalone relays only): a JSON object with an integer
  `version` in [0, 2^53), for /fetch a list of 1..`MAX_SOURCES` sources (relay URLs as
  `http(s)://` strings, the store last as a spec string or object) and the 64-hex-digit
  `manifest_sha256` the controller announced (required: without it the manifest would be
  whatever the last source, named by the caller, serves).
"""

from __future__ import annotations

import math
import re

MAX_KEY = 512
MAX_SOURCES = 16
MAX_VERSION = 1 << 53
_KEY = re.compile(r"[\x21-\x7e]+")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class BadParam(ValueError):
    """A request parameter out of its type or range (HTTP 400)."""


def wait_s(raw: str | None, max_wait_s: float) -> float:
    """The `wait` query parameter: seconds in [0, max_wait_s]; absent = 0."""
    if raw is None or raw == "":
        return 0.0
    if len(raw) > 32:
        raise BadParam("wait is too long")
    try:
        value = float(raw)
    except ValueError:
        raise BadParam("wait must be a number") from None
    if not math.isfinite(value) or not 0.0 <= value <= max_wait_s:
        raise BadParam(f"wait must be a finite number of seconds in [0, {max_wait_s:g}]")
    return value


def key(raw: str) -> str:
    """A store key a relay may look up."""
    if not 0 < len(raw) <= MAX_KEY or not _KEY.fullmatch(raw) or "\\" in raw:
        raise BadParam(f"a key is 1..{MAX_KEY} printable ASCII characters")
    if any(seg in ("", ".", "..") for seg in raw.split("/")):
        raise BadParam("a key has no empty, '.' or '..' segment")
    return raw


def version(body) -> int:
    """`body["version"]`: an integer in [0, 2^53) (a JSON float or bool is refused)."""
    if not isinstance(body, dict):
        raise BadParam("the body must be a JSON object")
    v = body.get("version")
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < MAX_VERSION:
        raise BadParam(f"version must be an integer in [0, {MAX_VERSION})")
    return v


def fetch_body(body) -> tuple[int, list, str]:
    """(version, sources, manifest_sha256) of a POST /fetch body."""
    v = version(body)
    sources = body.get("sources")
    if not isinstance(sources, list) or not 1 <= len(sources) <= MAX_SOURCES:
        raise BadParam(f"sources must be a list of 1..{MAX_SOURCES} entries")
    for i, s in enumerate(sources):
        last = i == len(sources) - 1
        is_relay = isinstance(s, str) and s.startswith(("http://", "https://"))
        if not (is_relay or (last and isinstance(s, str | dict))):
            raise BadParam("sources are http(s) relay URLs, then the store (a spec) last")
        if isinstance(s, str) and (len(s) > 1024 or not s.isprintable()):
            raise BadParam("a source is at most 1024 printable characters")
    sha = body.get("manifest_sha256")
    if not (isinstance(sha, str) and _SHA256.fullmatch(sha)):
        raise BadParam("manifest_sha256 (the announced manifest's) must be 64 lowercase hex digits")
    return v, sources, sha
