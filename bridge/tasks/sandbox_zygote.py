"""The sandbox's helper process (bridge/tasks/sandbox.py): reads one JSON request a line on
stdin, forks a child per call that limits itself and runs the tool, answers one JSON line
{"ok", "text"} on stdout. Standard library only, run as a script:

    python -I -S bridge/tasks/sandbox_zygote.py '["sys.path entries", ...]'
"""

import importlib
import json
import os
import resource
import select
import shutil
import signal
import sys
import sysconfig
import tempfile
import time

_NETWORK = ("socket.", "urllib.", "http.", "ftplib.", "smtplib.", "nntplib.", "imaplib.")
_PROCESSES = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
              "os.fork", "os.forkpty", "pty.spawn", "os.startfile")  # fmt: skip
_NATIVE = ("ctypes.", "cffi.")
_PATH_EVENTS = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
                "os.link", "os.symlink", "os.truncate", "os.utime", "os.listdir",
                "os.scandir", "os.chdir", "shutil.", "glob.glob")  # fmt: skip
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


class SandboxViolation(PermissionError):
    pass


def _read_roots() -> tuple[str, ...]:
    """What a tool may read outside its directory: the Python installation (lazy imports)."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    roots |= {
        v
        for k, v in sysconfig.get_paths().items()
        if k in ("stdlib", "platstdlib", "purelib", "platlib")
    }
    return tuple(os.path.realpath(r) for r in roots if r)


def _guard(scratch: str):
    scratch = os.path.realpath(scratch)
    readable = _read_roots()

    def inside(path, roots) -> bool:
        if isinstance(path, int):
            return True  # an already open descriptor (ours: the result pipe)
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, str):
            return False
        real = os.path.realpath(path)
        return any(real == r or real.startswith(r + os.sep) for r in roots)

    def hook(event: str, args):
        if event.startswith(_NETWORK):
            raise SandboxViolation("network access is not allowed in the sandbox")
        if event.startswith(_PROCESSES):
            raise SandboxViolation("starting processes is not allowed in the sandbox")
        if event.startswith(_NATIVE):
            raise SandboxViolation("native code (ctypes) is not allowed in the sandbox")
        if event == "open":
            path, mode, flags = (list(args) + [None, None, 0])[:3]
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & _WRITE_FLAGS
            )
            roots = (scratch,) if writes else (scratch, *readable)
            if not inside(path, roots):
                raise SandboxViolation(f"files outside the scratch directory: {path!r}")
        elif event.startswith(_PATH_EVENTS):
            for a in args:
                if isinstance(a, str | bytes) and not inside(a, (scratch,)):
                    raise SandboxViolation(f"files outside the scratch directory: {a!r}")

    return hook


def _child(target, arguments: dict, limits: dict, scratch: str, out_fd: int) -> None:
    cpu, mem = int(limits["cpu_s"]), int(limits["memory_mb"]) << 20
    with open("/proc/self/statm") as f:  # the interpreter's own address space, in pages
        base = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (base + mem, base + mem))
    fsize = int(limits["file_mb"]) << 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    nofile = max(int(limits["open_files"]), out_fd + 1)
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.chdir(scratch)
    sys.addaudithook(_guard(scratch))
    try:
        ok, text = True, str(target(**arguments))
    except MemoryError:
        ok, text = (
            False,
            f"stopped: the tool went over its memory limit ({limits['memory_mb']} MiB)",
        )
    except SandboxViolation as e:
        ok, text = False, f"stopped: {e}"
    except TypeError as e:
        ok, text = False, f"bad arguments or a failing tool: TypeError: {e}"
    except BaseException as e:  # noqa: BLE001 - the tool is user code
        ok, text = False, f"the tool raised {type(e).__name__}: {e}"
    text = text[: int(limits["output_chars"])]
    os.write(out_fd, json.dumps({"ok": ok, "text": text}).encode())


def _run(req: dict, tools: dict) -> dict:
    limits, target = req["limits"], req["target"]
    if target not in tools:
        module, _, name = target.partition(":")
        try:
            tools[target] = getattr(importlib.import_module(module), name)
        except Exception as e:  # noqa: BLE001 - a tool that cannot be loaded is reported
            return {
                "ok": False,
                "text": f"tool {target!r} cannot be loaded: {type(e).__name__}: {e}",
            }
    scratch = tempfile.mkdtemp(prefix="echo2_tool_")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            _child(tools[target], dict(req["arguments"]), limits, scratch, w)
        finally:
            os._exit(0)
    os.close(w)
    data, timed_out = b"", False
    deadline = time.monotonic() + float(limits["wall_s"])
    while True:
        left = deadline - time.monotonic()
        ready = select.select([r], [], [], max(left, 0))[0] if left > 0 else []
        if not ready:
            timed_out = True
            os.kill(pid, signal.SIGKILL)
            break
        chunk = os.read(r, 1 << 16)
        if not chunk:
            break
        data += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    shutil.rmtree(scratch, ignore_errors=True)
    if timed_out:
        return {
            "ok": False,
            "text": f"stopped: the tool ran past its {limits['wall_s']} s wall-clock limit",
        }
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL):
        return {
            "ok": False,
            "text": f"stopped: the tool used up its {limits['cpu_s']} s of CPU time",
        }
    try:
        return json.loads(data)
    except ValueError:
        how = (
            f"signal {os.WTERMSIG(status)}"
            if os.WIFSIGNALED(status)
            else f"exit {os.WEXITSTATUS(status)}"
        )
        return {"ok": False, "text": f"stopped: the tool died ({how}) without a result"}


def main() -> None:
    sys.path[:0] = json.loads(sys.argv[1])
    tools: dict = {}
    for line in sys.stdin:
        try:
            reply = _run(json.loads(line), tools)
        except Exception as e:  # noqa: BLE001 - a bad request is answered, the loop lives
            reply = {"ok": False, "text": f"the sandbox could not run the call: {e}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
