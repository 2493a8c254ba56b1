"""What one submission costs the controller, counted, not timed (docs/design/lease-path.md).

At 500 workers @ 2 s the controller is bound by its CPU per accepted submission. Two fixed
costs are guarded here through a real controller (SQLite file, reward pool):

- A learner waiting for a batch is woken once the buffer holds that batch, not by every
  submission: each wake-up was a try that took the controller's lock twice and a write
  transaction, ~one per submission (~256 per batch at the bench's batch size), on the path
  every lease and submission queues on.
- A submission takes the controller's lock once and runs a fixed list of SQLite statements
  (its checks on the read-only connection without the lock, its acceptance on the writer):
  the statements are listed below; one more per submission is a cost every worker pays.
"""

import threading
import time

from controller_helpers import make, submit_all, worker

from bridge.control import learner_api
from bridge.control.protocol import LeaseRequest

ONE = LeaseRequest(worker_version=0, max_groups=1)


class CountingLock:
    """The controller's RLock, counting the acquisitions made by each thread."""

    def __init__(self, lock):
        self.lock, self.by_thread = lock, {}

    def _count(self):
        me = threading.get_ident()
        self.by_thread[me] = self.by_thread.get(me, 0) + 1

    def acquire(self, *args, **kwargs):
        got = self.lock.acquire(*args, **kwargs)
        if got:
            self._count()
        return got

    def release(self):
        self.lock.release()

    def __enter__(self):
        self.lock.acquire()
        self._count()
        return self

    def __exit__(self, *exc):
        self.lock.release()


def _waiting_learner(ctl, monkeypatch, num_groups):
    """A learner thread in `wait_batch(0, num_groups)` that tries only when woken (no
    periodic retry within the test), and the list of its tries."""
    monkeypatch.setattr(learner_api, "RETRY_S", 600.0)
    tries, real, out = [], ctl.take_batch, []

    def take_batch(step, n):
        tries.append(step)
        return real(step, n)

    ctl.take_batch = take_batch
    learner = threading.Thread(target=lambda: out.append(ctl.wait_batch(0, num_groups, 600)))
    learner.start()
    deadline = time.monotonic() + 60
    while not tries and time.monotonic() < deadline:  # its first try (a miss) is done
        time.sleep(0.01)
    assert tries, "the learner never tried"
    return learner, tries, out


def test_a_waiting_learner_tries_once_per_batch_not_once_per_submission(tmp_path, monkeypatch):
    k = 5
    ctl = make(tmp_path, groups_per_step=k, max_groups_per_lease=1)
    ctl.publish(0)
    w = worker(ctl)
    learner, tries, out = _waiting_learner(ctl, monkeypatch, k)
    for _ in range(k):
        lease = ctl.lease(w, ONE).lease
        assert len(submit_all(ctl, w, lease).accepted) == 1
        time.sleep(0.05)  # room for a wake-up per submission to show, were there any
    learner.join(60)
    batch, _ = out[0]
    assert batch is not None and len(batch) == k
    # The miss it started with, then the try that the k-th submission's wake-up made.
    assert len(tries) == 2, tries
    ctl.close()


def test_a_submission_takes_the_lock_once_and_a_fixed_list_of_statements(tmp_path, monkeypatch):
    ctl = make(tmp_path, groups_per_step=4, max_groups_per_lease=1)
    ctl.publish(0)
    w = worker(ctl)
    learner, _, out = _waiting_learner(ctl, monkeypatch, 4)  # the steady state: it waits
    submit_all(ctl, w, ctl.lease(w, ONE).lease)  # the counters' kv rows read once, cached
    lease = ctl.lease(w, ONE).lease
    statements = []
    conns = (ctl.db.conn, ctl.db.reader())
    for conn in conns:
        conn.set_trace_callback(statements.append)
    ctl.lock = counting = CountingLock(ctl.lock)
    reply = submit_all(ctl, w, lease)
    ctl.lock = counting.lock
    for conn in conns:
        conn.set_trace_callback(None)
    assert len(reply.accepted) == 1
    assert counting.by_thread == {threading.get_ident(): 1}, counting.by_thread
    # The check, on the read-only connection: the lease, its groups, its version. The
    # acceptance: BEGIN; the lease and its groups again (they may have moved meanwhile);
    # the group buffered (a statement SQLite's trace repeats for each of the three
    # triggers it fires); the accepted groups' and trajectories' counters (their values
    # cached); the lease done, its episode rows deleted; the worker's measured rate; the
    # buffered count for the waiting learner; COMMIT.
    assert len(statements) == 3 + 1 + 2 + 4 + 2 + 2 + 1 + 1 + 1, "\n".join(statements)
    for _ in range(2):  # the learner's batch, so that it ends
        lease = ctl.lease(w, ONE).lease
        submit_all(ctl, w, lease)
    learner.join(60)
    assert out[0][0] is not None
    ctl.close()
