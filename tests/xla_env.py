"""XLA_FLAGS for the suite's short, compile-bound child JAX processes (the training binary's
few-step runs, multihost peers, the reduced GPU-learner bench, the export CLI).

Only the host device count is the child's own: every other flag of this process's XLA_FLAGS
is kept, so the suite's compile-time flags (tests/conftest.py) reach it: train_test.py's
binary runs took 84 -> 25 CPU seconds, multihost_test.py 164 -> 130. A child that runs as a
user's run does (one device, a whole SFT + RL run, e.g. train_rl_test.py) drops XLA_FLAGS
altogether instead: its steps' run time outweighs compiling them, and unoptimized code runs
slower (300 SFT steps of the tiny demo: 20.6 CPU s at XLA's defaults, 37.1 at level 0).
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
