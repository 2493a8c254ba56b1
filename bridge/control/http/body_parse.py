"""Large request bodies scanned and parsed in other processes, so the server's GIL stays free.

pydantic-core builds a submission's Python objects holding the GIL from the first byte to
the last, and the JSON bound scan (http_guard.py `json_bounds`) holds it too. Done in the
server's process, a big body stalls every other request, heartbeats on the event loop
included: three concurrent ~14 MB submissions took the heartbeats' p99 from ~18 ms to
~1.2 s (bench/body_parse.py). A body of at least `min_bytes` goes to a small pool of
parser processes instead (`ParsePool`): the child runs the bound scan, validates the whole
`Submission` with the same model and rules, and sends back each trajectory with its token
ids, log-probs and versions as numpy arrays, pickled out of band (protocol 5): they arrive
by `recv_into` in one buffer, the GIL released, and are unpickled as views on it, no copy.
What the server holds the GIL for per large body is then a few objects per trajectory:

- `admit(lease_id)` first (service.py: the controller's own lease check, unknown 404,
  another worker's 403): a body for a lease its worker does not hold is refused before one
  per-token Python object exists in the server;
- then the model, rebuilt trajectory by trajectory from the validated values
  (`model_construct`: no second validation), one trajectory's lists at a time (at most
  65,536 values each, ~1 ms), the event loop running in between;
- and when the controller is done with it, the submission is freed on that pool thread in
  pieces (`free_in_pieces`; a refusal goes back `without_frames`): freed in one go, ~2 M
  objects are one C-level cascade of 30-100 ms with no point where the GIL can change
  hands, and a refusal's traceback would carry it to the event loop, to be freed there
  while every heartbeat waits (the largest stall in a py-spy --gil profile of the bench).

Other paths' large bodies get their bound scan in a child too (`bounds`). A parser that
died while idle (killed) is replaced before the next body; one that dies mid-parse is
replaced and that body refused (413); one silent for `timeout_s` (stopped, hung) is killed
and replaced, and that body answered 503.

What a parse may cost in memory is bounded twice: by the bytes before it starts
(http_guard.py: containers and values per byte, nesting), and in the child by a limit on
its data segment of `PARSE_MEMORY_FACTOR` x the body (RLIMIT_DATA, set around each parse):
a body past it is refused (413), and its cost never lands in the server's process.
"""

from __future__ import annotations

import os
import pickle
import queue
import resource
import socket
import struct
import subprocess
import sys
import threading

import numpy as np
import pydantic

from bridge.control.http.http_guard import json_bounds
from bridge.control.protocol import GroupResult, Submission, WorkerTrajectory

_FLOATS = ("logprobs",)
_INTS = ("prompt_token_ids", "completion_token_ids", "versions", "completion_mask")
_INT32 = np.iinfo(np.int32)
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
    if name in _FLOATS:  # validated: all of one type
        return np.array(values, dtype=np.float64)
    try:
        ints = np.array(values, dtype=np.int64)
    except OverflowError:  # past 64 bits: stays a list (the controller's checks refuse it)
        return list(values)
    # Token ids and versions fit 32 bits: half the bytes the server receives.
    narrow = ints.size and _INT32.min <= ints.min() and ints.max() <= _INT32.max
    return ints.astype(np.int32) if narrow else ints


def _unpack(value):
    return value.tolist() if isinstance(value, np.ndarray) else value


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


def free_in_pieces(trajectories: list[WorkerTrajectory]) -> None:
    """Drop `trajectories` (the caller's only list of them) one at a time.

    A maximum-size submission is ~2.4 M Python ints and floats. Freed at once (its last
    reference dropped) that is one C-level cascade, ~30-100 ms with the GIL held and no
    point at which the interpreter can hand it to another thread; one trajectory is a
    ~1 ms piece, and between pieces a waiting thread (the event loop) gets the GIL. A
    trajectory something else still holds is not freed here, only its reference."""
    while trajectories:
        trajectories.pop()


def without_frames(e: BaseException) -> BaseException:
    """`e` without its traceback and chained exceptions: their frames hold the request's
    objects (a whole submission), which would otherwise be freed wherever the reply is
    written, on the event loop. What the reply says (status, message) is kept."""
    e.__traceback__ = e.__context__ = e.__cause__ = None
    return e


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


_HEAD = struct.Struct("!QQ")  # a message: its pickle's bytes, then its buffers' bytes


def _read(sock: socket.socket, n: int) -> memoryview:
    """Exactly `n` bytes from `sock`, into one buffer allocated up front: `recv_into`
    holds the GIL only between reads (`Connection.recv`'s reads allocate a bytes object
    of the whole remainder per read, then copy: ~20 ms of GIL per 12 MiB reply)."""
    buf = memoryview(np.empty(n, dtype=np.uint8))  # not zeroed first: recv_into fills it
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:])
        if k == 0:
            raise EOFError("the other end closed")
        got += k
    return buf


def _send(sock: socket.socket, obj, data: bytes | None = None) -> None:
    """`obj` pickled (protocol 5: numpy arrays out of band), its buffers and `data` after
    it, each by `sendall` straight from its memory, the GIL released while it is written."""
    buffers: list = []
    pickled = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    raws = [b.raw() for b in buffers] + ([memoryview(data)] if data is not None else [])
    sizes = [r.nbytes for r in raws]
    meta = pickle.dumps((pickled, sizes))
    sock.sendall(_HEAD.pack(len(meta), sum(sizes)) + meta)
    for r in raws:
        sock.sendall(r)


def _receive(sock: socket.socket, with_data: bool = False):
    """What `_send` sent: the object (its arrays views on one received buffer, no copy),
    and, `with_data`, the trailing bytes."""
    meta_len, total = _HEAD.unpack(_read(sock, _HEAD.size))
    pickled, sizes = pickle.loads(_read(sock, meta_len))
    data = _read(sock, total) if total else memoryview(b"")
    views, at = [], 0
    for n in sizes:
        views.append(data[at : at + n])
        at += n
    trailing = views.pop() if with_data else None
    obj = pickle.loads(pickled, buffers=views)
    return (obj, trailing) if with_data else obj


def _child(sock: socket.socket) -> None:
    """A parser process: (call name, args) and the body, per request; the reply back.
    Ends when the server's end of the socket closes (the server stopped, or died). Niced:
    on a busy machine the server's own thread (heartbeats, leases) gets the CPU first."""
    os.nice(10)
    Submission.model_validate_json(  # the imports and pydantic's model build, up front
        b'{"lease_id": "x", "groups": [{"group_id": 0, "trajectories": []}]}'
    )
    while True:
        try:
            (name, args), body = _receive(sock, with_data=True)
        except (EOFError, OSError):
            return
        body = body.tobytes()
        reply = _within_budget(name, body, args)
        del body
        _send(sock, reply)


def _child_main(fd: int) -> None:
    """`python -c` entry of a parser process: its end of the socket pair is `fd`."""
    _child(socket.socket(fileno=fd))


class _Parser:
    """One parser process: a fresh interpreter (`python -c`, not multiprocessing's spawn,
    which would import the parent's main module: in the training binary, JAX) on a socket
    pair. It exits when the server's end closes, the server's death included."""

    def __init__(self, timeout_s: float):
        ours, theirs = socket.socketpair()
        ours.settimeout(timeout_s)  # each read, and each body's whole send
        entry = (
            "from bridge.control.http.body_parse import _child_main; "
            f"_child_main({theirs.fileno()})"
        )
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", entry], pass_fds=[theirs.fileno()], env=env
        )
        theirs.close()
        self.sock = ours

    def call(self, name: str, body: bytes, args: tuple):
        # The body goes by send(2) straight from its buffer, the GIL released: a pickle
        # of it (ProcessPoolExecutor's way) was one GIL-held copy of up to 16 MiB. The
        # reply's arrays come back the same way, into one buffer (`_receive`).
        _send(self.sock, (name, args), body)
        return _receive(self.sock)

    def close(self) -> None:
        self.sock.close()
        try:
            self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5.0)


class ParsePool:
    """`processes` parser processes, started at the first large body; `min_bytes`: smaller
    bodies are parsed in the caller (microseconds to a few milliseconds). The calls block:
    make them from a thread."""

    def __init__(self, processes: int = 2, min_bytes: int = 128 << 10, timeout_s: float = 120.0):
        self.processes, self.min_bytes = max(1, processes), min_bytes
        # A parser that sends nothing for this long (stopped, hung, starved) is killed and
        # replaced, and its body answered 503: a large body's thread never waits forever.
        self.timeout_s = timeout_s
        self._idle: queue.Queue[_Parser] | None = None
        self._all: list[_Parser] = []
        self._lock = threading.Lock()
        self._closed = False
        self.parsed = 0  # bodies parsed by the pool (tests, metrics)
        self.rebuilt = 0  # of those, rebuilt as Python objects here (`submission`'s admit)

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
        p = _Parser(self.timeout_s)
        self._all.append(p)
        return p

    def _call(self, name: str, body: bytes, args: tuple):
        idle = self._start()
        parser = idle.get()
        try:
            if parser.proc.poll() is not None:  # died while idle (killed): not this body's doing
                parser = self._replace(parser)
            return parser.call(name, body, args)
        except TimeoutError:
            parser = self._replace(parser)
            why = f"the body's parser process did not answer within {self.timeout_s:g} s"
            raise BodyRefused(503, why) from None
        except (EOFError, OSError):
            # The child died mid-parse: past its memory budget (pydantic-core aborts when an
            # allocation fails), or killed. A fresh one takes its place; this body, which
            # may kill the next one too, is refused.
            parser = self._replace(parser)
            raise BodyRefused(413, _TOO_COSTLY) from None
        finally:
            idle.put(parser)

    def _replace(self, parser: _Parser) -> _Parser:
        parser.close()
        with self._lock:
            self._all.remove(parser)
            return self._spawn()

    def bounds(self, body: bytes, max_depth: int, max_elements: int):
        """`json_bounds` of `body`, in a child."""
        try:
            return self._call("bounds", body, (max_depth, max_elements))
        except BodyRefused as e:
            return e.status, e.detail

    def submission(self, body: bytes, max_depth: int, max_elements: int, admit=None) -> Submission:
        """`body` as a validated `Submission`; raises `BodyRefused` for a body over a
        bound (413) or invalid (422). `admit(lease_id)`, if given, may raise for a lease
        the submission cannot be for: a large body's per-token Python objects are built
        in this process only once it has passed (`rebuilt` counts them); a small body's
        lease is left to the caller."""
        if not self.large(body):
            try:  # `admit` left to the controller's own check: nothing to save here
                return Submission.model_validate_json(body)
            except pydantic.ValidationError as e:
                raise BodyRefused(422, _errors(e)) from None
        result = self._call("submission", body, (max_depth, max_elements))
        self.parsed += 1
        if result[0] == "refused":
            raise BodyRefused(result[1], result[2])
        if admit is not None:
            admit(result[1][0])
        self.rebuilt += 1
        return rebuild_submission(result[1])

    def close(self) -> None:
        with self._lock:
            self._closed, parsers, self._all = True, self._all, []
        for p in parsers:
            p.close()
