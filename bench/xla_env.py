"""XLA_FLAGS for a child JAX process (a training binary, a multihost peer, a bench run).

A child either runs on one device, as a user's run does, or on N virtual CPU devices. Only
the host device count is the child's own: every other flag of the caller's XLA_FLAGS is
kept, so the test suite's compile-time flags (tests/conftest.py) reach the binaries and
peers it starts, and a user's own flags reach the runs a bench starts.
"""

from __future__ import annotations

import os

DEVICE_COUNT = "--xla_force_host_platform_device_count"


def xla_flags(devices: int | None = None, flags: str | None = None) -> str:
    """`flags` (default: this process's XLA_FLAGS) without any host device count, plus
    `devices` virtual CPU devices when given (None: one device)."""
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    kept = [f for f in flags.split() if f.split("=", 1)[0] != DEVICE_COUNT]
    if devices is not None:
        kept.append(f"{DEVICE_COUNT}={devices}")
    return " ".join(kept)


def child_env(devices: int | None = None, env: dict | None = None, **extra: str) -> dict:
    """A copy of `env` (default: os.environ) with `xla_flags(devices)` and `extra` set."""
    out = dict(os.environ if env is None else env)
    flags = xla_flags(devices, out.get("XLA_FLAGS", ""))
    if flags:
        out["XLA_FLAGS"] = flags
    else:
        out.pop("XLA_FLAGS", None)
    out.update(extra)
    return out
