"""The join secret a registration must present, rotatable while the run goes on.

    secret = JoinSecret.from_file("<workdir>/join_token", grace_s=600)
    secret.matches(candidate)   # the current secret, or a replaced one within its grace

Rotation: write a new secret into the token file (atomically: write a temporary file in
the same directory, then `mv` it over the old one). The controller notices the change at
the next registration or operator call (it re-reads the file when its size, mtime or inode
change, checking at most every `check_every_s`); the replaced secret is accepted for
`grace_s` more, so workers that are starting with it can still join. Registered workers
keep their bearer tokens: rotation only gates new registrations. A worker started with
`--token_file` re-reads that file when it registers again (rollout_gpu/session.py), so
local workers follow a rotation by themselves.

An empty or unreadable file is logged and ignored (the current secret stays): a
half-finished edit must not lock every worker out or let anyone in.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable


def read_secret(path: str) -> str:
    with open(path) as f:
        secret = f.read().strip()
    if not secret:
        raise ValueError(f"join secret file {path} is empty")
    return secret


class JoinSecret:
    def __init__(
        self,
        secret: str,
        path: str | None = None,
        grace_s: float = 600.0,
        check_every_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not secret:
            raise ValueError("the join secret is empty")
        self.path, self.grace_s, self.check_every_s, self.clock = (
            path,
            grace_s,
            check_every_s,
            clock,
        )
        self._current = secret
        self._previous: list[tuple[str, float]] = []  # (secret, accepted until)
        self._stat = self._file_stat()
        self._checked = clock()
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: str, **kwargs) -> JoinSecret:
        return cls(read_secret(path), path, **kwargs)

    def _file_stat(self):
        if self.path is None:
            return None
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def current(self) -> str:
        self.refresh()
        return self._current

    def refresh(self, force: bool = False) -> bool:
        """Re-read the file if it changed; True if the secret was rotated now."""
        if self.path is None:
            return False
        with self._lock:
            now = self.clock()
            if not force and now - self._checked < self.check_every_s:
                return False
            self._checked = now
            st = self._file_stat()
            if st == self._stat:
                return False
            self._stat = st
            try:
                new = read_secret(self.path)
            except (OSError, ValueError) as e:
                logging.warning("join secret file unusable, keeping the current secret: %s", e)
                return False
            if new == self._current:
                return False
            self._previous = [(s, t) for s, t in self._previous if t > now and s != new]
            self._previous.append((self._current, now + self.grace_s))
            self._current = new
            logging.warning(
                "join secret rotated (%s); the old one is accepted for %.0fs more",
                self.path,
                self.grace_s,
            )
            return True

    def accepted(self) -> list[str]:
        """The secrets a registration may present now: the current one and those replaced
        within their grace (per-worker credentials are minted from these, identity.py)."""
        self.refresh()
        now = self.clock()
        return [self._current] + [s for s, until in list(self._previous) if until > now]

    def matches(self, candidate: str) -> bool:
        """Constant-time against every accepted secret (no early exit on a match)."""
        self.refresh()
        now, got = self.clock(), candidate.encode()
        ok = hmac.compare_digest(got, self._current.encode())
        for secret, until in list(self._previous):
            ok |= hmac.compare_digest(got, secret.encode()) and until > now
        return ok


def load_or_create_join_secret(workdir: str, token_file: str | None = None) -> str:
    """The join secret from `token_file`, else from (or generated into) <workdir>/join_token."""
    if token_file:
        with open(token_file) as f:
            secret = f.read().strip()
        if not secret:
            raise ValueError(f"join secret file {token_file} is empty")
        return secret
    path = os.path.join(workdir, "join_token")
    os.makedirs(workdir, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return load_or_create_join_secret(workdir, path)
    secret = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret
