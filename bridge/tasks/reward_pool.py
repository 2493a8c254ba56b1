"""A killable process pool for reward functions: every call has a timeout, and a call that
overruns is stopped by killing its worker process, which is then replaced.

    pool = RewardPool(processes=2, timeout_s=5.0)
    value = pool.call(math_reward.math_verify_score, "\\frac12", "0.5")  # RewardTimeout on hang
    pool.stats()  # {"reward/calls": 1, "reward/timeouts": 0, "reward/errors": 0, ...}

Why processes, and why not `multiprocessing.Pool`: math-verify times out with
`signal.alarm` (main thread only), and a sympy call stuck in C code cannot be interrupted
from a thread at all, so the only reliable stop is killing a process. `multiprocessing.Pool`
cannot kill one stuck task without tearing down the pool, so each worker here is its own
process with its own pipe. Workers are fresh interpreters (`python -c`), not
`multiprocessing` spawn children: spawn re-imports the parent's `__main__` module in every
child, which for the training binary would mean importing jax in each reward worker.

The pool is generic: `fn` is any top-level function of an importable module (pickled by
reference; the child gets the parent's `sys.path`), called with picklable arguments. A
function that raises, returns something unpicklable or kills its worker becomes a
`RewardError`; a timeout a `RewardTimeout`; each is counted in `stats()`. Calls from several
threads run concurrently, one per worker; more callers than workers wait their turn (the
wait does not count against the timeout).

`guarded_call` is what tasks use: inline when no timeout is asked for or when already running
inside a pool worker (the outer pool's timeout covers it), otherwise through `default_pool()`.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import pickle
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from bridge.tasks.base import RewardError

DEFAULT_TIMEOUT_S = 5.0  # math-verify's own default per parse/verify step
STARTUP_TIMEOUT_S = 120.0  # a fresh interpreter on a loaded 2-core machine can be slow

_IN_WORKER = False  # set in pool workers: nested guarded calls run inline


class RewardTimeout(RewardError):
    """A reward call ran past its timeout; its worker process was killed and replaced."""


def fn_name(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


class _Worker:
    """One worker process and the two pipe ends the parent talks to it through."""

    def __init__(self, preload: tuple[str, ...]):
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        code = (
            "import json, sys; sys.path[:0] = json.loads(sys.argv[1]); "
            "from bridge.tasks.reward_pool import _worker_main; "
            "_worker_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, json.dumps(sys.path)]
            + [str(to_child_r), str(from_child_w), ",".join(preload)],
            pass_fds=(to_child_r, from_child_w),
            stdin=subprocess.DEVNULL,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self.send, self.recv = Connection(to_child_w, readable=False), Connection(from_child_r)
        self.ready = False

    def wait_ready(self) -> None:
        if self.ready:
            return
        if not self.recv.poll(STARTUP_TIMEOUT_S):
            raise RewardError(f"reward worker did not start within {STARTUP_TIMEOUT_S:.0f} s")
        status, detail = self.recv.recv()
        if status != "ready":
            raise RewardError(f"reward worker failed to start: {detail}")
        self.ready = True

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.send.close()
        self.recv.close()


def _exit_with_parent(parent: int) -> None:
    # An idle worker sees its pipe close when the parent dies, but one stuck in a hung call
    # never reads it again; without this it would spin on as an orphan.
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _worker_main(read_fd: int, write_fd: int, preload: str) -> None:
    """Child side: run each (fn, args, kwargs) received and send back ("ok"|"err", value)."""
    global _IN_WORKER
    _IN_WORKER = True
    # Ctrl-C in a terminal signals the whole process group; stopping is the parent's call.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    recv, send = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    try:
        for module in filter(None, preload.split(",")):
            __import__(module)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises
        send.send(("error", f"preloading failed: {type(e).__name__}: {e}"))
        return
    send.send(("ready", None))
    while True:
        try:
            data = recv.recv_bytes()
        except (EOFError, OSError):
            return  # the parent is gone or closed us
        try:
            # Unpickling imports the function's module, and the call names the modules it
            # needs: loaded apart, so the call's timeout covers the call and not a first
            # import on a busy machine.
            imports, fn, args, kwargs = pickle.loads(data)
            for module in imports:
                if module not in sys.modules and module != "__main__":
                    importlib.import_module(module)
        except BaseException as e:  # noqa: BLE001 - an import may raise anything
            send.send(("err", f"{type(e).__name__}: {e}"))
            continue
        send.send(("loaded", None))
        try:
            out = ("ok", fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - a reward function may raise anything
            out = ("err", f"{type(e).__name__}: {e}")
        try:
            send.send(out)
        except Exception as e:  # noqa: BLE001 - e.g. an unpicklable return value
            send.send(("err", f"result could not be sent back: {type(e).__name__}: {e}"))


class RewardPool:
    """`processes` workers, started on first use; `call` runs one function with a timeout."""

    def __init__(
        self,
        processes: int = 2,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        preload: tuple[str, ...] = (),
    ):
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        self.timeout_s, self.preload = float(timeout_s), tuple(preload)
        # A slot holds a started worker or None (start one when the slot is next taken), so
        # the pool costs nothing until used and a replacement never delays the failing call.
        self._slots: queue.Queue[_Worker | None] = queue.Queue()
        for _ in range(processes):
            self._slots.put(None)
        self._lock = threading.Lock()
        self._stats = {"reward/calls": 0, "reward/timeouts": 0, "reward/errors": 0}
        self._stats["reward/restarts"] = 0
        self._closed = False

    def _count(self, key: str) -> None:
        with self._lock:
            self._stats[key] += 1

    def stats(self) -> dict[str, int]:
        """Counters since the pool was made: calls, timeouts, errors, worker restarts."""
        with self._lock:
            return dict(self._stats)

    def call(
        self,
        fn: Callable,
        *args: Any,
        timeout_s: float | None = None,
        imports: tuple[str, ...] = (),
        **kwargs: Any,
    ):
        """`fn(*args, **kwargs)` in a worker; RewardTimeout past `timeout_s` (default: the
        pool's), RewardError if it raises or its worker dies. `imports`: modules the call
        needs (a task defined outside bridge.tasks registers itself when imported); the
        worker imports them while loading the call, outside its timeout."""
        if self._closed:
            raise RewardError("reward pool is closed")
        timeout = self.timeout_s if timeout_s is None else float(timeout_s)
        name = fn_name(fn)
        self._count("reward/calls")
        try:
            payload = pickle.dumps((tuple(imports), fn, args, kwargs))
        except Exception as e:  # noqa: BLE001 - lambdas, closures, open files...
            self._count("reward/errors")
            raise RewardError(f"{name}: cannot be sent to a reward worker: {e}") from e
        worker = self._slots.get()
        try:
            if worker is None:
                worker = _Worker(self.preload)
            try:
                worker.wait_ready()
            except RewardError:
                worker = self._replace(worker)  # a fresh one for the next caller
                self._count("reward/errors")
                raise
            worker.send.send_bytes(payload)
            # Loading (unpickling, so importing the function's module) is bounded like a
            # start-up; the call's own timeout starts when the worker says it has loaded.
            if not worker.recv.poll(STARTUP_TIMEOUT_S):
                worker = self._replace(worker)
                self._count("reward/timeouts")
                raise RewardTimeout(
                    f"{name} was not loaded within {STARTUP_TIMEOUT_S:.0f} s; its worker was killed"
                )
            status, value = worker.recv.recv()
            if status == "loaded":
                start = time.monotonic()
                if not worker.recv.poll(timeout):
                    worker = self._replace(worker)
                    self._count("reward/timeouts")
                    raise RewardTimeout(
                        f"{name} timed out after {time.monotonic() - start:.1f} s "
                        f"(limit {timeout:g} s); its worker was killed"
                    )
                status, value = worker.recv.recv()
        except (EOFError, OSError) as e:
            code = None
            if worker is not None:
                try:  # its pipe closed; the exit status follows within moments
                    code = worker.proc.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    pass
            worker = self._replace(worker)
            self._count("reward/errors")
            raise RewardError(f"{name}: reward worker died (exit code {code}): {e}") from e
        finally:
            if self._closed and worker is not None:
                worker.kill()  # closed while this call ran
                worker = None
            self._slots.put(worker)
        if status != "ok":
            self._count("reward/errors")
            raise RewardError(f"{name} raised {value}")
        return value

    def _replace(self, worker: _Worker | None) -> _Worker | None:
        if worker is not None:
            worker.kill()
        self._count("reward/restarts")
        if self._closed:
            return None
        try:
            return _Worker(self.preload)  # started now; its startup overlaps the caller's work
        except OSError:
            return None  # e.g. out of processes: the slot's next caller tries again

    def close(self) -> None:
        """Stop every idle worker; busy ones are stopped when their call returns."""
        self._closed = True
        while True:
            try:
                worker = self._slots.get_nowait()
            except queue.Empty:
                return
            if worker is not None:
                worker.kill()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_DEFAULT: RewardPool | None = None
_DEFAULT_LOCK = threading.Lock()


def default_pool() -> RewardPool:
    """The process-wide pool (started on first use, closed at exit); its stats are the
    process's reward timeouts and errors."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            # math-verify (sympy) takes ~1 s to import; loaded before a worker reports ready,
            # so a first math reward on a busy machine does not spend its timeout importing.
            preload = ("math_verify",) if importlib.util.find_spec("math_verify") else ()
            _DEFAULT = RewardPool(processes=min(4, os.cpu_count() or 1), preload=preload)
            atexit.register(_DEFAULT.close)
        return _DEFAULT


def guarded_call(fn: Callable, *args: Any, timeout_s: float | None, **kwargs: Any):
    """`fn(*args, **kwargs)` under a timeout in `default_pool()`; inline when `timeout_s` is
    None or <= 0, or when this process already is a pool worker."""
    if _IN_WORKER or timeout_s is None or timeout_s <= 0:
        return fn(*args, **kwargs)
    return default_pool().call(fn, *args, timeout_s=timeout_s, **kwargs)
