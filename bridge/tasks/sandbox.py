"""Tools run in a sandbox: a time, memory and file budget, no network, no files outside a
scratch directory. What breaks a limit is stopped and reported as text for the model.

    box = Sandbox(Limits(cpu_s=2, wall_s=5, memory_mb=256))
    result = box.call("bridge.tools.calculator:calculator", {"expr": "37*48"})
    result.ok, result.text          # (True, "1776") or (False, "stopped: ...")

How. One long-lived helper process (the zygote, `sandbox_zygote.py`, stdlib only) imports
each tool's module once and forks a child per call (a fork is ~1 ms; a fresh interpreter
per call, ~50 ms, would be most of an RL step on this CPU). The child, before it runs the
tool:
- `resource.setrlimit`: RLIMIT_CPU (CPU seconds; SIGXCPU stops it), RLIMIT_AS (address
  space: the tool's allocations past `memory_mb` fail with MemoryError), RLIMIT_FSIZE,
  RLIMIT_NOFILE, RLIMIT_CORE 0. The zygote also kills it at `wall_s` wall-clock seconds (a
  tool that sleeps or blocks uses no CPU).
- a fresh temporary working directory (removed after the call).
- a Python audit hook (PEP 578), which it cannot remove: sockets, processes, ctypes, and
  files outside the scratch directory (reads of the Python installation excepted, so a
  tool can still import lazily) raise `SandboxViolation`.
- and, where the machine allows it, the zygote runs in its own network namespace with
  only a down loopback (`unshare -n` as root; `unshare -rn`, a user namespace, for a
  non-root user where the kernel enables unprivileged user namespaces): the kernel itself
  has no route anywhere, even for code that got past the audit hook.
  `network_isolation()` says which layer a machine got ("netns", "userns+netns", or
  "audit-hook" only).

Limits any user gets: setrlimit lowers limits without privileges, audit hooks need none.
What the audit hook is not: a boundary against native code; a tool that loads C code
(ctypes is refused, but a compiled extension module it imports is not) needs the
namespace layer, or a container / gVisor runtime, which this module does not provide.

A call answers a `ToolResult`; a tool that raises, loops, allocates, opens a socket or a
file outside its directory, or is called with arguments it does not take is `ok=False`
with a sentence that says so, never an exception in the caller. Results are capped at
`output_chars`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import select
import shutil
import subprocess
import sys
import threading

_ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_zygote.py")


@dataclasses.dataclass(frozen=True)
class Limits:
    cpu_s: int = 2  # CPU seconds per call
    wall_s: float = 5.0  # wall-clock seconds per call
    memory_mb: int = 256  # address space the tool may add to the forked interpreter's
    file_mb: int = 1  # largest file it may write (in its scratch directory)
    open_files: int = 32
    output_chars: int = 2000

    def __post_init__(self):
        if not (self.cpu_s >= 1 and self.wall_s > 0 and self.memory_mb >= 1):
            raise ValueError(f"sandbox limits must be positive, got {self}")


@dataclasses.dataclass(frozen=True)
class ToolResult:
    ok: bool
    text: str  # the tool's result as text, or why it was stopped


@functools.cache
def network_isolation() -> tuple[tuple[str, ...], str]:
    """(command prefix that starts a process without network, its name). Probed once:
    `unshare -n` (root), `unshare -rn` (a user namespace, for other users where the
    kernel allows), else no prefix: the audit hook alone refuses sockets."""
    unshare = shutil.which("unshare")
    if unshare:
        for prefix, name in (((unshare, "-n"), "netns"), ((unshare, "-rn"), "userns+netns")):
            try:
                ok = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if ok.returncode == 0:
                return prefix, name
    return (), "audit-hook"


class Sandbox:
    """Runs tool calls (`"module:function"`, keyword arguments from the call's JSON) under
    `limits`, one at a time per instance (a lock), in its own zygote process, started on
    first use and restarted if it dies."""

    def __init__(self, limits: Limits = Limits(), isolate_network: bool = True):
        self.limits = limits
        prefix, self.isolation = network_isolation() if isolate_network else ((), "audit-hook")
        self._prefix = list(prefix)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0"}
        paths = json.dumps([p for p in sys.path if p])  # so the zygote imports tools as we do
        return subprocess.Popen(
            [*self._prefix, sys.executable, "-I", "-S", _ZYGOTE, paths],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # our signals (a Ctrl-C) are not the tool's
        )

    def call(self, target: str, arguments: dict) -> ToolResult:
        if not isinstance(arguments, dict):
            return ToolResult(False, "arguments must be a JSON object")
        request = {
            "target": target,
            "arguments": arguments,
            "limits": dataclasses.asdict(self.limits),
        }
        try:
            line = json.dumps(request) + "\n"
        except (TypeError, ValueError) as e:
            return ToolResult(False, f"arguments are not JSON: {e}")
        with self._lock:
            for attempt in (0, 1):  # one restart: the zygote may have been killed
                if self._proc is None or self._proc.poll() is not None:
                    self._proc = self._start()
                try:
                    return self._ask(line)
                except (OSError, ValueError) as e:
                    self._kill()
                    if attempt:
                        return ToolResult(False, f"the sandbox failed: {e}")
        raise AssertionError("unreachable")

    def _ask(self, line: str) -> ToolResult:
        proc = self._proc
        proc.stdin.write(line.encode())
        proc.stdin.flush()
        # The zygote answers within wall_s (it kills the call at wall_s); more is a hang.
        ready, _, _ = select.select([proc.stdout], [], [], self.limits.wall_s + 10.0)
        if not ready:
            raise OSError("the sandbox did not answer")
        reply = proc.stdout.readline()
        if not reply:
            raise OSError("the sandbox exited")
        out = json.loads(reply)
        return ToolResult(bool(out["ok"]), str(out["text"])[: self.limits.output_chars])

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def close(self) -> None:
        with self._lock:
            self._kill()

    def __del__(self):
        try:
            self._kill()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


_BOXES: dict[tuple[int, Limits], Sandbox] = {}


def sandbox_for(limits: Limits) -> Sandbox:
    """This process's sandbox for `limits` (a forked reward-pool worker gets its own: a
    zygote's pipes are not shared across processes)."""
    key = (os.getpid(), limits)
    if key not in _BOXES:
        _BOXES[key] = Sandbox(limits)
    return _BOXES[key]
