"""A rollout worker asked to stop (SIGTERM) at the moments that matter, against a real
controller on loopback, every wait a poll on the controller's state:

- with a lease active and the grace time long enough: a real worker process submits the
  lease (it ends `done`, its groups buffered within the grace time), takes no other lease,
  leaves and exits 0. Fails if the handler does nothing (no exit) or the worker drops its
  lease when the signal arrives (the lease ends `released`: `leave()` would release it
  anyway, so the test looks at how the lease ended, not at what is held afterwards);
- past the grace time: the lease is released and its groups requeued, no earlier than the
  grace time after the stop (in-process on the session's engine);
- during warm-up (vLLM's first generation, ~20 s here): no lease is granted afterwards.
  The warm-up is held open by the test, so the stop lands inside it by construction.

The in-process tests call `request_stop`, which is what the signal handler calls
(rollout_gpu/lifecycle.py: install_stop_signals); the process test sends the real signal.
"""

import signal
import threading
import time

import pytest
import worker_procs
from worker_procs import leases, wait_for

from bridge.control.http.service import load_or_create_join_secret
from bridge.control.protocol import WorkerProfile

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

THROTTLE_S = 4.0  # each lease is held this long before generating: the signal lands in it
GRACE_S = 20.0


def groups_of(ctl, lease_id):
    return ctl.db.q("SELECT * FROM groups WHERE lease_id=?", (lease_id,))


def fresh_lease(ctl, proc=None):
    """The active lease taken less than a second ago (THROTTLE_S - 1 s of it left), if any."""
    assert proc is None or proc.poll() is None, "the worker died"
    rows = leases(ctl, state="active")
    return rows[0] if rows and time.time() - rows[0]["created_at"] < 1.0 else None


def test_sigterm_with_an_active_lease_submits_it_and_exits_0(tmp_path, tiny_model_dir):
    workdir = str(tmp_path)
    ctl, server = worker_procs.serve_tiny(workdir, lease_ttl_s=3.0)
    flags = (f"--throttle_s={THROTTLE_S}", f"--grace_s={GRACE_S}")
    proc, log = worker_procs.spawn_worker(server.url, workdir, tiny_model_dir, "term", 1, flags)
    logs = {"term": log}
    try:
        lease = wait_for("no lease", lambda: fresh_lease(ctl, proc), 300, logs)
        held = [g["group_id"] for g in groups_of(ctl, lease["lease_id"])]
        assert held and all(g["state"] == "leased" for g in groups_of(ctl, lease["lease_id"]))
        proc.send_signal(signal.SIGTERM)
        signalled = time.time()
        assert proc.wait(timeout=GRACE_S + 10) == 0, worker_procs.tail(logs)

        assert ctl.db.lease(lease["lease_id"])["state"] == "done", worker_procs.tail(logs)
        groups = groups_of(ctl, lease["lease_id"])
        assert sorted(g["group_id"] for g in groups) == sorted(held)
        for g in groups:
            assert g["state"] == "buffered" and g["accepted_at"] - signalled < GRACE_S
        wid = lease["worker_id"]
        assert [r["lease_id"] for r in leases(ctl, wid)] == [lease["lease_id"]]
        assert ctl.db.worker(wid)["left_at"] is not None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server.stop()
        ctl.close()


# -- in-process, on the session's engine -------------------------------------------------------
class GatedWarmUp:
    """The session's engine, whose first `generate` (the worker's warm-up) waits until the
    test lets it go."""

    def __init__(self, engine):
        self._engine = engine
        self.entered, self.go = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, *args, **kwargs):
        if not self.entered.is_set():
            self.entered.set()
            assert self.go.wait(120)
        return self._engine.generate(*args, **kwargs)


@pytest.fixture
def served(tmp_path):
    # Version 0 = the engine's own weights (seed 0), so the swap leaves the shared engine as
    # is. A TTL that outlasts any test: expiry must not be what ends a lease here.
    ctl, server = worker_procs.serve_tiny(str(tmp_path), lease_ttl_s=120.0)
    yield ctl, server
    server.stop()
    ctl.close()


def start_worker(server, workdir, engine, **options):
    from rollout_gpu.worker import RolloutWorker, WorkerOptions

    opts = WorkerOptions(
        relay=False,  # no peers here; the flag's default (a relay) is for real fleets
        controller=server.url,
        join_secret=load_or_create_join_secret(workdir),
        profile=WorkerProfile(accelerator="cpu", price_per_hour=0.0, max_concurrent_sequences=8),
        **options,
    )
    worker = RolloutWorker(opts, engine=engine)
    thread = threading.Thread(target=worker.run, daemon=True, name="worker")
    thread.start()
    return worker, thread


def test_a_stop_during_warm_up_takes_no_lease(served, vllm_engine, tmp_path):
    ctl, server = served
    engine = GatedWarmUp(vllm_engine)
    worker, thread = start_worker(server, str(tmp_path), engine)
    wait_for("warm-up not reached", engine.entered.is_set, 120)
    assert leases(ctl) == []
    worker.request_stop()
    engine.go.set()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert leases(ctl) == [], "a lease was granted after the stop"
    assert ctl.db.worker(worker.session.worker_id)["left_at"] is not None


def test_a_stop_within_the_grace_time_submits_the_lease(served, vllm_engine, tmp_path):
    ctl, server = served
    worker, thread = start_worker(
        server, str(tmp_path), vllm_engine, throttle_s=THROTTLE_S, grace_s=GRACE_S
    )
    lease = wait_for("no lease", lambda: fresh_lease(ctl), 120)
    worker.request_stop()
    thread.join(timeout=GRACE_S + 10)
    assert not thread.is_alive() and worker.leases_done == 1
    assert ctl.db.lease(lease["lease_id"])["state"] == "done"
    groups = groups_of(ctl, lease["lease_id"])
    assert groups and all(g["state"] == "buffered" for g in groups)
    assert len(leases(ctl)) == 1


def test_past_the_grace_time_the_lease_is_released_and_requeued(served, vllm_engine, tmp_path):
    ctl, server = served
    grace_s = 1.0
    worker, thread = start_worker(
        server, str(tmp_path), vllm_engine, throttle_s=120.0, grace_s=grace_s
    )
    lease = wait_for("no lease", lambda: leases(ctl, state="active"), 120)[0]
    held = [g["group_id"] for g in groups_of(ctl, lease["lease_id"])]
    assert held
    t0 = time.monotonic()
    worker.request_stop()
    thread.join(timeout=grace_s + 10)
    assert not thread.is_alive() and worker.leases_done == 0
    assert time.monotonic() - t0 >= grace_s  # it used its grace time before giving up
    assert ctl.db.lease(lease["lease_id"])["state"] == "released"
    marks = ",".join("?" * len(held))
    rows = ctl.db.q(f"SELECT * FROM groups WHERE group_id IN ({marks})", tuple(held))
    assert [(r["state"], r["lease_id"], r["payload"]) for r in rows] == [
        ("queued", None, None)
    ] * len(held)
