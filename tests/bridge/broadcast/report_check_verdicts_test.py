"""Each verdict of the corrupt-chunk check (bridge/broadcast/report_check.check_chunk) on
every path it guards, against a loopback "relay" that serves what a test tells it (the
store's own chunk bytes, a flipped or padded or endless body, an error status, nothing at
all), and the background checker's queue: bounded, never killed by a check or a callback.

The end-to-end flow through the controller and real relays is report_check_test.py.
"""

import http.server
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from bridge.broadcast import chunks as chunks_lib
from bridge.broadcast import report_check
from bridge.store.weight_store import WeightStore

VERSION = 3


class Relay(http.server.ThreadingHTTPServer):
    """`GET /kv/<key>` answered by `self.serve(key) -> (status, body or iterator)`."""

    daemon_threads = True

    def __init__(self):
        self.serve, self.queries = None, []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(h):  # noqa: N802 - the stdlib's name
                path, _, query = h.path.partition("?")
                self.queries.append(query)
                status, body = self.serve(path.removeprefix("/kv/"))
                h.send_response(status)
                if isinstance(body, bytes):
                    h.send_header("Content-Length", str(len(body)))
                    h.end_headers()
                    h.wfile.write(body)
                    return
                h.end_headers()  # streamed until the client hangs up
                try:
                    for piece in body:
                        h.wfile.write(piece)
                except OSError:
                    pass

            def log_message(h, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.handle_error = lambda request, address: None  # a client that hung up
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("store")
    store = WeightStore(str(root))
    rng = np.random.default_rng(0)
    # "z" is all zeros: the store writes no chunk of it, so a relay answers 404 for it.
    arrays = [("a", rng.standard_normal((64, 32)).astype(np.float32)),
              ("b", rng.standard_normal((300,)).astype(np.float32)),
              ("z", np.zeros((16,), np.float32))]  # fmt: skip
    store.publish(VERSION, 1, arrays, {}, dtype="float32")
    plan = chunks_lib.chunk_plan(VERSION, store.manifest(VERSION))
    relay = Relay()
    threading.Thread(target=relay.serve_forever, daemon=True).start()
    yield store, root, plan, relay
    relay.shutdown()


def _stored(root: Path, key: str):
    path = root / key
    return (200, path.read_bytes()) if path.exists() else (404, b"")


def _check(world, key, serve, **kw):
    store, root, _, relay = world
    relay.serve = lambda k: serve(k, _stored(root, k))
    return report_check.check_chunk(store.spec, relay.url, VERSION, key, **kw)


def _chunk(world, stored: bool):
    _, root, plan, _ = world
    for s in plan:
        if (root / s.key).exists() == stored:
            return s
    raise AssertionError("no such chunk in the plan")


def test_an_intact_chunk_is_ok_and_the_check_asks_without_waiting(world):
    spec = _chunk(world, stored=True)
    assert _check(world, spec.key, lambda k, stored: stored) == "ok"
    assert world[3].queries[-1] == "wait=0"  # a relay without the chunk answers at once

    def pieces(k, stored):  # the same bytes in small pieces, as a slow link delivers them
        def gen():
            for i in range(0, len(stored[1]), 8):
                yield stored[1][i : i + 8]
                time.sleep(0.01)

        return 200, gen()

    assert _check(world, spec.key, pieces) == "ok"


def test_every_wrong_body_is_corrupt(world):
    spec = _chunk(world, stored=True)
    flip = lambda k, s: (200, bytes([s[1][0] ^ 1]) + s[1][1:])
    assert _check(world, spec.key, flip) == "corrupt"
    assert _check(world, spec.key, lambda k, s: (200, s[1][:-1])) == "corrupt"  # short
    assert _check(world, spec.key, lambda k, s: (200, s[1] + b"\0")) == "corrupt"  # long
    assert _check(world, spec.key, lambda k, s: (404, b"")) == "corrupt"  # claims absent
    assert _check(world, spec.key, lambda k, s: (200, b"")) == "corrupt"


def test_an_endless_body_is_corrupt_after_one_chunk_length(world):
    spec = _chunk(world, stored=True)
    sent = []

    def endless(k, s):
        def gen():
            while True:
                sent.append(1)
                yield s[1]
                time.sleep(0.001)

        return 200, gen()

    assert _check(world, spec.key, endless) == "corrupt"
    assert len(sent) < 1000  # stopped reading once past the chunk's length


def test_an_absent_chunk_of_fill_values_is_ok(world):
    spec = _chunk(world, stored=False)
    assert _check(world, spec.key, lambda k, stored: stored) == "ok"  # 404 = all zeros
    assert _check(world, spec.key, lambda k, s: (200, bytes(spec.full_nbytes))) == "ok"
    assert _check(world, spec.key, lambda k, s: (200, b"\1" * spec.full_nbytes)) == "corrupt"


def test_nothing_proven_is_unknown_and_a_key_of_no_chunk_is_no_chunk(world):
    store, root, plan, relay = world
    spec = _chunk(world, stored=True)
    for status in (500, 503, 403, 201):
        assert _check(world, spec.key, lambda k, s, st=status: (st, s[1])) == "unknown"
    relay.serve = lambda k: _stored(root, k)
    assert report_check.check_chunk(store.spec, relay.url, VERSION + 1, spec.key) == "unknown"
    dead = "http://127.0.0.1:9"  # nothing listens: connection refused
    assert report_check.check_chunk(store.spec, dead, VERSION, spec.key) == "unknown"
    assert report_check.check_chunk(store.spec, relay.url, VERSION, "data/3/a/c/9/9") == (
        "no_chunk"
    )
    asked = len(relay.queries)
    report_check.check_chunk(store.spec, relay.url, VERSION, "data/3/a/c/9/9")
    assert len(relay.queries) == asked  # no chunk: the relay is not even asked


def test_a_relay_slower_than_the_timeout_is_unknown(world):
    spec = _chunk(world, stored=True)

    def late(
        k, s
    ):  # the intact chunk, 3 s late: past the check's 0.5 s, within httpx's 5 s default
        time.sleep(3.0)
        return s

    assert _check(world, spec.key, late, timeout_s=0.5) == "unknown"


def test_checker_runs_checks_in_order_on_one_thread_and_survives_errors():
    seen, done = [], threading.Event()

    def check(store, url, version, key):
        if key == "boom":
            raise RuntimeError("a check that raises")
        return f"{store}|{url}|{version}|{key}|{threading.current_thread().name}"

    def record(verdict):
        seen.append(verdict)
        if verdict == "unknown":
            raise RuntimeError("a callback that raises")
        if len(seen) == 4:
            done.set()

    checker = report_check.ReportChecker(check)
    assert checker.submit("s", "u", 1, "k1", record)
    assert checker.submit("s", "u", 2, "boom", record)
    assert checker.submit("s", "u", 3, "k3", record)
    assert checker.submit("s", "u", 4, "k4", record)
    assert done.wait(30), seen
    assert seen == ["s|u|1|k1|report-check", "unknown", "s|u|3|k3|report-check",
                    "s|u|4|k4|report-check"]  # fmt: skip
    assert checker._thread.daemon


def test_checker_holds_at_most_max_pending_waiting_checks():
    release, started = threading.Event(), threading.Event()
    verdicts = []

    def slow(store, url, version, key):
        started.set()
        release.wait(30)
        return "ok"

    for max_pending, checker in ((32, report_check.ReportChecker(slow)),
                                 (2, report_check.ReportChecker(slow, max_pending=2))):  # fmt: skip
        release.clear(), started.clear(), verdicts.clear()
        assert checker.submit(None, "u", 0, "first", verdicts.append)
        assert started.wait(30)  # the thread holds the first: the queue is empty
        assert all(
            checker.submit(None, "u", 0, f"k{i}", verdicts.append) for i in range(max_pending)
        )
        assert not checker.submit(None, "u", 0, "one too many", verdicts.append)
        release.set()
        end = time.monotonic() + 30
        while len(verdicts) < max_pending + 1 and time.monotonic() < end:
            time.sleep(0.01)
        assert verdicts == ["ok"] * (max_pending + 1)  # the refused one is never answered
