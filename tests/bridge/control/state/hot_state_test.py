"""Hot state in memory (issue 25, bridge/control/state/hot_state.py and db_leases.py), through
real HTTP on loopback: a heartbeat takes no controller lock and runs no SQL statement (it is
answered while another thread holds the lock and another connection holds the database's
write lock), its renewals and gauges reach the file within the flush interval, and after a
crash (no close, no final flush) a new controller on the same file rebuilds the state: the
token works, the lease granted before the crash is still valid although its persisted
deadline passed while the controller was down, the gauges persisted before the crash are
back, and the worker's work is accepted. A graceful stop (SIGTERM) of the controller's
own process writes the hot state before it exits."""

import sqlite3
import time

import httpx
from controller_helpers import Clock, make, register, submission_json

from bridge.control.config import ControllerConfig
from bridge.control.http.service import ServerOptions, load_or_create_join_secret, serve_controller
from bridge.control.process import DB_FILE, ControllerProcess
from bridge.tasks import make_task


def _serve(ctl, workdir):
    server = serve_controller(ctl, workdir, ServerOptions(max_body_bytes=1 << 20))
    return server, httpx.Client(base_url=server.url, timeout=10)


def _row(db_path, sql, args=()):
    """One row read from the file alone, on a connection of our own."""
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        return conn.execute(sql, args).fetchone()
    finally:
        conn.close()


def _poll(what, fn, timeout_s=30.0):
    deadline = time.monotonic() + timeout_s
    while not (value := fn()):
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
    return value


def _lease(ctl, client, headers):
    r = client.post("/v1/lease", headers=headers, json={"worker_version": 0, "max_groups": 1})
    assert r.status_code == 200 and r.json()["lease"], r.text
    return r.json()["lease"]


def _beat(client, headers, **gauges):
    r = client.post("/v1/heartbeat", headers=headers, json={"worker_version": 0, **gauges})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_heartbeat_takes_no_lock_and_runs_no_sql(tmp_path):
    clock = Clock()
    ctl = make(tmp_path, clock, lease_ttl_s=10.0, hot_flush_s=0.05)
    ctl.publish(0, {"driver": "memory"})
    server, client = _serve(ctl, str(tmp_path))
    db_path = str(tmp_path / "ctl.db")
    try:
        headers = register(client, load_or_create_join_secret(str(tmp_path)))
        lease = _lease(ctl, client, headers)
        granted = _row(
            db_path, "SELECT expires_at FROM leases WHERE lease_id=?", (lease["lease_id"],)
        )
        assert granted == (clock.t + 10.0,)  # the grant is durable at once
        statements = []
        writer = sqlite3.connect(db_path, isolation_level=None)
        with ctl.lock:  # every other operation (and the flusher) waits; a heartbeat does not
            writer.execute("BEGIN IMMEDIATE")  # and the database's write lock is taken
            ctl.db.conn.set_trace_callback(statements.append)
            for _ in range(3):
                clock.t += 4.0
                reply = _beat(client, headers, samples_per_s=7.5, tokens_per_s=60.0)
                assert reply["renewed_leases"] == [lease["lease_id"]]
            ctl.db.conn.set_trace_callback(None)
            writer.execute("ROLLBACK")
        writer.close()
        assert statements == []
        # 12 s after the grant, past its first deadline: renewed in memory, and the
        # flusher writes the renewal and the gauges within its interval.
        moved = lambda: _row(
            db_path, "SELECT expires_at FROM leases WHERE lease_id=?", (lease["lease_id"],)
        ) == (clock.t + 10.0,)  # fmt: skip
        _poll("the renewal never reached the file", moved)
        gauges = "SELECT samples_per_s, tokens_per_s, last_seen FROM workers"
        _poll(
            "the gauges never reached the file",
            lambda: _row(db_path, gauges) == (7.5, 60.0, clock.t),
        )
        r = client.post("/v1/submit", headers=headers, json=submission_json(lease))
        assert r.status_code == 200 and r.json()["accepted"], r.text
    finally:
        server.stop()
        ctl.close()


def test_after_a_crash_the_hot_state_is_rebuilt_and_granted_leases_stay_valid(tmp_path):
    clock = Clock()
    workdir, db_path = str(tmp_path), str(tmp_path / "ctl.db")
    ctl = make(tmp_path, clock, lease_ttl_s=10.0, hot_flush_s=0)  # flushes only when asked
    ctl.publish(0, {"driver": "memory"})
    server, client = _serve(ctl, workdir)
    headers = register(client, load_or_create_join_secret(workdir))
    lease = _lease(ctl, client, headers)
    clock.t += 5.0
    assert _beat(client, headers, samples_per_s=3.0)["renewed_leases"] == [lease["lease_id"]]
    ctl.flush_hot()  # a periodic flush: deadline 1015, samples_per_s 3.0 on disk
    clock.t += 5.0
    _beat(client, headers, samples_per_s=9.0)  # in memory only: lost in the crash
    # The crash: the server goes, the controller is never closed (no final flush).
    server.stop()
    lease_row = "SELECT expires_at, state FROM leases WHERE lease_id=?"
    assert _row(db_path, lease_row, (lease["lease_id"],)) == (1015.0, "active")
    assert _row(db_path, "SELECT samples_per_s FROM workers") == (3.0,)

    clock.t += 60.0  # down for a minute: the persisted deadline (1015) is long past
    ctl2 = make(tmp_path, clock, lease_ttl_s=10.0, hot_flush_s=0)
    server, client = _serve(ctl2, workdir)
    try:
        assert ctl2.db.deadlines.deadline(lease["lease_id"]) == clock.t + 10.0  # conservative
        hot = ctl2.workers.hot.get(ctl2.authenticate(headers["Authorization"][7:]))
        assert (hot.samples_per_s, hot.last_seen) == (3.0, 1005.0)  # as persisted
        reply = _beat(client, headers)  # the token map was rebuilt from the table
        assert reply["renewed_leases"] == [lease["lease_id"]]
        r = client.post("/v1/submit", headers=headers, json=submission_json(lease))
        assert r.status_code == 200 and r.json()["accepted"], r.text
        assert _row(db_path, lease_row, (lease["lease_id"],))[1] == "done"  # durable at once
        # A lease nobody renews still expires, a TTL after its last renewal.
        again = _lease(ctl2, client, headers)
        clock.t += 10.5
        ctl2.flush_hot()
        assert _row(db_path, lease_row, (again["lease_id"],))[1] == "expired"
        assert _beat(client, headers)["renewed_leases"] == []
    finally:
        server.stop()
        ctl2.close()
        ctl.db.close()


def test_a_graceful_stop_of_the_controller_process_writes_the_hot_state(tmp_path, text_codec):
    workdir = str(tmp_path)
    cfg = ControllerConfig(vocab_size=100, hot_flush_s=3600.0)  # no periodic flush in here
    proc = ControllerProcess(cfg, workdir, make_task("arithmetic"), text_codec, ServerOptions())
    proc.start()
    try:
        with httpx.Client(base_url=proc.url, timeout=30) as client:
            headers = register(client, load_or_create_join_secret(workdir))
            _beat(client, headers, samples_per_s=4.5, tokens_per_s=36.0)
    finally:
        proc.stop()  # SIGTERM
    path = str(tmp_path / DB_FILE)
    assert _row(path, "SELECT samples_per_s, tokens_per_s FROM workers") == (4.5, 36.0)
