"""Large request bodies scanned and parsed in other processes, so the server's GIL stays free.

pydantic-core builds a submission's Python objects holding the GIL from the first byte to
the last, and the JSON bound scan (http_guard.py `json_bounds`) holds it too. Done in the
server's process, a big body stalls every other request, heartbeats on the event loop
included: three concurrent ~14 MB submissions took the heartbeats' p99 from ~18 ms to
~1.2 s (bench/body_parse.py). A body of at least `min_bytes` goes to a small pool of
parser processes instead (`ParsePool`): the child runs the bound scan, validates the whole
`Submission` with the same model and rules, and sends back each trajectory with its token
ids, log-probs and versions packed as arrays (a few objects per trajectory, not one per
token). The server rebuilds the model trajectory by trajectory from those validated values
(`model_construct`: no second validation), so it holds the GIL for one trajectory's lists
at a time (at most 65,536 values each, well under a millisecond), and the event loop runs
in between. Other paths' large bodies get their bound scan there too (`bounds`).

What a parse may cost in memory is bounded twice: by the bytes before it starts
(http_guard.py: containers and values per byte, nesting), and in the child by a limit on
its data segment of `PARSE_MEMORY_FACTOR` x the body (RLIMIT_DATA, set around each parse):
a body past it is refused (413), and its cost never lands in the server's process.
"""

from __future__ import annotations

import array
import multiprocessing.connection
import os
import queue
import resource
import socket
import subprocess
import sys
import threading

import pydantic

from bridge.control.http.http_guard import json_bounds
from bridge.control.protocol import GroupResult, Submission, WorkerTrajectory

_FLOATS = ("logprobs",)
_INTS = ("prompt_token_ids", "completion_token_ids", "versions", "completion_mask")
_MAX_ERRORS = 64  # a body of a million bad values gets the first of them, not a million


class BodyRefused(Exception):
    """A body refused before or by its parse: `status` (413: over a bound; 422: invalid),
    `detail` (a string, or pydantic's error list with `loc` from the body's root)."""

    def __init__(self, status: int, detail):
        super().__init__(detail)
        self.status, self.detail = status, detail


def _pack(name: str, values):
    if values is None:
        return None
    for code in ("d",) if name in _FLOATS else ("i", "q"):  # validated: all of one type
        try:
            return code, array.array(code, values).tobytes()
        except OverflowError:  # past 32 bits, then past 64 (refused by the controller's checks)
            continue
    return list(values)


def _unpack(value):
    if isinstance(value, tuple):
        code, blob = value
        out = array.array(code)
        out.frombytes(blob)
        return out.tolist()
    return value


def _errors(e: pydantic.ValidationError) -> list[dict]:
    return [
        {"loc": list(x["loc"]), "msg": x["msg"], "type": x["type"]}
        for x in e.errors()[:_MAX_ERRORS]
    ]


def parse_submission_packed(body: bytes, max_depth: int, max_elements: int) -> tuple:
    """In the child: ("refused", status, detail) or ("ok", packed submission)."""
    if bad := json_bounds(body, max_depth, max_elements):
        return "refused", *bad
    try:
        sub = Submission.model_validate_json(body)
    except pydantic.ValidationError as e:
        return "refused", 422, _errors(e)
    groups = []
    for g in sub.groups:
        trajs = []
        for t in g.trajectories:
            fields = {k: getattr(t, k) for k in t.model_fields_set}
            for k in _FLOATS + _INTS:
                if k in fields:
                    fields[k] = _pack(k, fields[k])
            trajs.append(fields)
        groups.append((g.group_id, trajs))
    return "ok", (sub.lease_id, groups)


def rebuild_submission(packed: tuple) -> Submission:
    """In the server: the child's validated values as the model, one trajectory at a time."""
    lease_id, groups = packed
    out = []
    for group_id, trajs in groups:
        built = []
        for fields in trajs:
            values = {k: _unpack(v) for k, v in fields.items()}
            # The fields set are those the worker sent (the child passes only those).
            built.append(WorkerTrajectory.model_construct(**values))
        out.append(GroupResult.model_construct(group_id=group_id, trajectories=built))
    return Submission.model_construct(lease_id=lease_id, groups=out)


_CHILD_CALLS = {"bounds": json_bounds, "submission": parse_submission_packed}
# A parse may grow the parser's memory by this many times the body (RLIMIT_DATA): an honest
# submission costs ~8x (pydantic-core's JSON tree, then the Python objects); shapes that
# pass the byte-level bounds can cost more (a body of `[0,0,0]` lists: 43x), and are refused.
PARSE_MEMORY_FACTOR = 16
_SLACK = 32 << 20  # allocator granularity, the reply's pickle


def _data_bytes() -> int:
    """This process's data segment (heap and private anonymous mappings): what
    RLIMIT_DATA limits."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[5]) * os.sysconf("SC_PAGE_SIZE")


def _within_budget(name: str, body: bytes, args: tuple):
    """The call, its memory limited to PARSE_MEMORY_FACTOR x the body. A Python allocation
    past it raises MemoryError (refused here); pydantic-core's (Rust) aborts the process,
    which the server also answers with a 413 (`ParsePool._call`)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = _data_bytes() + PARSE_MEMORY_FACTOR * len(body) + _SLACK
    resource.setrlimit(resource.RLIMIT_DATA, (min(limit, hard) if hard > 0 else limit, hard))
    try:
        return _CHILD_CALLS[name](body, *args)
    except MemoryError:
        why = _TOO_COSTLY
        return ("refused", 413, why) if name == "submission" else (413, why)
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


_TOO_COSTLY = f"JSON that costs more than {PARSE_MEMORY_FACTOR}x its size to parse"


def _child(conn) -> None:
    """A parser process: (call name, args) then the body, per request; the reply pickled.
    Ends when the server's end of the pipe closes (the server stopped, or died). Niced:
    on a busy machine the server's own thread (heartbeats, leases) gets the CPU first."""
    os.nice(10)
    Submission.model_validate_json(  # the imports and pydantic's model build, up front
        b'{"lease_id": "x", "groups": [{"group_id": 0, "trajectories": []}]}'
    )
    while True:
        try:
            name, args = conn.recv()
            body = conn.recv_bytes()
        except (EOFError, OSError):
            return
        reply = _within_budget(name, body, args)
        del body
        conn.send(reply)


def _child_main(fd: int) -> None:
    """`python -c` entry of a parser process: its end of the socket pair is `fd`."""
    _child(multiprocessing.connection.Connection(fd))


class _Parser:
    """One parser process: a fresh interpreter (`python -c`, not multiprocessing's spawn,
    which would import the parent's main module: in the training binary, JAX) on a socket
    pair. It exits when the server's end closes, the server's death included."""

    def __init__(self):
        ours, theirs = socket.socketpair()
        entry = (
            "from bridge.control.http.body_parse import _child_main; "
            f"_child_main({theirs.fileno()})"
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", entry], pass_fds=[theirs.fileno()], env=env
        )
        theirs.close()
        self.conn = multiprocessing.connection.Connection(ours.detach())

    def call(self, name: str, body: bytes, args: tuple):
        self.conn.send((name, args))
        # The body goes by write(2) straight from its buffer, the GIL released: a pickle
        # of it (ProcessPoolExecutor's way) was one GIL-held copy of up to 16 MiB.
        self.conn.send_bytes(body)
        return self.conn.recv()

    def close(self) -> None:
        self.conn.close()
        try:
            self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5.0)


class ParsePool:
    """`processes` parser processes, started at the first large body; `min_bytes`: smaller
    bodies are parsed in the caller (microseconds to a few milliseconds). The calls block:
    make them from a thread."""

    def __init__(self, processes: int = 2, min_bytes: int = 128 << 10):
        self.processes, self.min_bytes = max(1, processes), min_bytes
        self._idle: queue.Queue[_Parser] | None = None
        self._all: list[_Parser] = []
        self._lock = threading.Lock()
        self._closed = False
        self.parsed = 0  # bodies parsed by the pool (tests, metrics)

    def pids(self) -> list[int]:
        """The parser processes' ids (tests, operators)."""
        with self._lock:
            return [p.proc.pid for p in self._all]

    def large(self, body: bytes) -> bool:
        return self.min_bytes > 0 and len(body) >= self.min_bytes

    def _start(self) -> queue.Queue:
        with self._lock:
            if self._closed:
                raise RuntimeError("the parser pool is closed")
            if self._idle is None:
                self._idle = queue.Queue()
                for _ in range(self.processes):
                    self._idle.put(self._spawn())
            return self._idle

    def _spawn(self) -> _Parser:
        p = _Parser()
        self._all.append(p)
        return p

    def _call(self, name: str, body: bytes, args: tuple):
        idle = self._start()
        parser = idle.get()
        try:
            return parser.call(name, body, args)
        except (EOFError, OSError):
            # The child died mid-parse: past its memory budget (pydantic-core aborts when an
            # allocation fails), or killed. A fresh one takes its place; this body, which
            # may kill the next one too, is refused.
            parser.close()
            with self._lock:
                self._all.remove(parser)
                parser = self._spawn()
            raise BodyRefused(413, _TOO_COSTLY) from None
        finally:
            idle.put(parser)

    def bounds(self, body: bytes, max_depth: int, max_elements: int):
        """`json_bounds` of `body`, in a child."""
        try:
            return self._call("bounds", body, (max_depth, max_elements))
        except BodyRefused as e:
            return e.status, e.detail

    def submission(self, body: bytes, max_depth: int, max_elements: int) -> Submission:
        """`body` as a validated `Submission`; raises `BodyRefused` for a body over a
        bound (413) or invalid (422)."""
        if not self.large(body):
            try:
                return Submission.model_validate_json(body)
            except pydantic.ValidationError as e:
                raise BodyRefused(422, _errors(e)) from None
        result = self._call("submission", body, (max_depth, max_elements))
        self.parsed += 1
        if result[0] == "refused":
            raise BodyRefused(result[1], result[2])
        return rebuild_submission(result[1])

    def close(self) -> None:
        with self._lock:
            self._closed, parsers, self._all = True, self._all, []
        for p in parsers:
            p.close()
