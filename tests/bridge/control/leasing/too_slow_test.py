"""Freshness-aware leasing (bridge/control/leasing/lease_timing.py): a worker whose measured lease
latency cannot return work fresh gets no work ("too_slow"), is measured again later, and the
refusal can be turned off; a slow lease whose work arrived fresh is no reason to refuse."""

import logging

import pytest
from controller_helpers import Clock, make, submit_all, worker

from bridge.control.leasing.lease_timing import _Latency
from bridge.control.protocol import LeaseRequest


def test_a_worker_too_slow_for_the_staleness_bound_gets_no_work(tmp_path):
    clock, S, train_s = Clock(), 1, 1.0
    ctl = make(
        tmp_path, clock, staleness=S, groups_per_step=1, max_groups_per_lease=1,
        retest_slow_after_s=100.0,
    )  # fmt: skip
    ctl.publish(0)
    slow, fast = worker(ctl), worker(ctl)
    slow_lease = ctl.lease(slow, LeaseRequest(worker_version=0)).lease  # not measured yet

    def learner_step(step):  # the fast worker makes the batch in 0.1 s, training takes 1 s
        lease = ctl.lease(fast, LeaseRequest(worker_version=step)).lease
        clock.t += 0.1
        submit_all(ctl, fast, lease, versions=(step, step, step))
        batch, stats = ctl.take_batch(step, 1)
        assert batch is not None
        clock.t += train_s
        ctl.publish(step + 1)
        return stats

    for step in range(5):
        learner_step(step)
    submit_all(ctl, slow, slow_lease)  # 5.5 s after its lease, at version 0: stale
    issued = ctl.db.lease(slow_lease.lease_id)["created_at"]
    assert ctl.timing.latency[slow].seconds == pytest.approx(clock.t - issued)
    # Independent arithmetic: steps every 1.1 s, the last batch 1.0 s ago, learner at step 5,
    # worker at version 5: a lease must be back within (5 + S - 5 + 1) * 1.1 - 1.0 = 1.2 s.
    assert ctl.timing.window_s(5, 5, clock.t) == pytest.approx(1.2)
    r = ctl.lease(slow, LeaseRequest(worker_version=5))
    assert r.lease is None and r.reason == "too_slow" and r.retry_after_s > 0
    stats = learner_step(5)
    assert stats["fleet/too_slow_workers"] == 1 and stats["staleness/dropped"] == 1
    # The fast worker keeps getting work; the slow one's version-0 group was requeued.
    assert ctl.lease(fast, LeaseRequest(worker_version=6)).lease is not None

    # The fleet runs short (the fast worker leaves): the learner waits, its step period
    # grows with the wait, and the slow worker's 5.5 s fits again: window = 2 * wait - wait
    # (the wait counts from the last batch, 1 s of training ago).
    ctl.leave(fast)
    clock.t += 4.0  # wait 5 s < 5.5 s
    assert ctl.lease(slow, LeaseRequest(worker_version=6)).reason == "too_slow"
    clock.t += 1.0  # wait 6 s
    assert ctl.lease(slow, LeaseRequest(worker_version=6)).lease is not None
    assert ctl.stats()["fleet/too_slow_workers"] == 0


def test_a_refused_worker_is_told_to_ask_again_when_the_next_batch_is_due(tmp_path):
    """Before the learner's next batch a lease's window only shrinks, so the refusal's
    retry_after_s is the time until that batch (at least the base retry_after_s)."""
    clock, train_s = Clock(), 5.0
    ctl = make(tmp_path, clock, staleness=0, groups_per_step=1, max_groups_per_lease=1,
               retest_slow_after_s=1000.0, retry_after_s=0.5)  # fmt: skip
    ctl.publish(0)
    slow, fast = worker(ctl), worker(ctl)
    for step in range(3):  # batches every 5.1 s
        lease = ctl.lease(fast, LeaseRequest(worker_version=step)).lease
        clock.t += 0.1
        submit_all(ctl, fast, lease, versions=(step, step, step))
        assert ctl.take_batch(step, 1)[0] is not None
        clock.t += 2.0 if step == 2 else train_s  # 2.0 s after the last batch
        ctl.publish(step + 1)
    # The slow worker's last lease took 30 s and came back stale (as lease_timing records).
    ctl.timing.latency[slow] = _Latency(seconds=30.0, measured_at=clock.t, late=True)
    r = ctl.lease(slow, LeaseRequest(worker_version=3))
    assert r.reason == "too_slow" and r.retry_after_s == pytest.approx(5.1 - 2.0)
    clock.t += 3.5  # overdue: the window grows again with the wait, so the base retry
    r = ctl.lease(slow, LeaseRequest(worker_version=3))
    assert r.reason == "too_slow" and r.retry_after_s == pytest.approx(0.5)


def one_lease_then_batches(tmp_path, batches, **cfg):
    """S=0: a worker takes a version-0 lease, then the learner takes `batches` batches one
    second apart (no worker needed: only the pace is recorded). Returns (clock, ctl, w, lease)."""
    clock = Clock()
    ctl = make(tmp_path, clock, staleness=0, groups_per_step=2, **cfg)
    ctl.publish(0)
    w = worker(ctl)
    lease = ctl.lease(w, LeaseRequest(worker_version=0)).lease
    for _ in range(batches):
        ctl.timing.batch_taken(clock.t)
        clock.t += 1.0
    return clock, ctl, w, lease


def test_a_too_slow_worker_is_measured_again_later(tmp_path):
    clock, ctl, w, lease = one_lease_then_batches(tmp_path, 3, retest_slow_after_s=30.0)
    ctl.db.put("next_step", 2)
    ctl.publish(2)
    submit_all(ctl, w, lease)  # 3 s, version 0 at step 2: late, and slower than the window
    assert ctl.lease(w, LeaseRequest(worker_version=2)).reason == "too_slow"
    # The window is still 0 s (the learner's 33 s wait counts as its step period: 1 * 33 -
    # 33), but the measurement is 31 s old and forgotten: one lease to measure again.
    clock.t += 31.0
    assert ctl.lease(w, LeaseRequest(worker_version=2)).lease is not None


def test_refusing_slow_workers_can_be_turned_off(tmp_path):
    clock, ctl, w, lease = one_lease_then_batches(tmp_path, 2, refuse_too_slow=False)
    ctl.db.put("next_step", 1)
    ctl.publish(1)
    submit_all(ctl, w, lease)  # version 0 at step 1: late
    assert ctl.lease(w, LeaseRequest(worker_version=1)).lease is not None
    assert ctl.stats()["fleet/too_slow_workers"] == 1  # still reported


def test_a_slow_lease_whose_work_was_used_is_no_reason_to_refuse(tmp_path):
    # Timing alone says too slow (3 s against a window of 0 s), but the work arrived fresh:
    # a fast worker with one slow lease on a loaded machine must keep its work.
    clock, ctl, w, lease = one_lease_then_batches(tmp_path, 3)
    submit_all(ctl, w, lease)  # version 0 while the learner is still at step 0: fresh
    assert ctl.timing.window_s(0, 0, clock.t) < ctl.timing.latency[w].seconds
    assert ctl.lease(w, LeaseRequest(worker_version=0)).lease is not None
    assert ctl.stats()["fleet/too_slow_workers"] == 0


def test_a_refused_worker_is_named_once_with_its_price(tmp_path, caplog):
    clock, ctl, w, lease = one_lease_then_batches(tmp_path, 3, retest_slow_after_s=30.0)
    ctl.db.put("next_step", 2)
    ctl.publish(2)
    submit_all(ctl, w, lease)  # late and slower than the window (as above)
    with caplog.at_level(logging.WARNING):
        assert ctl.lease(w, LeaseRequest(worker_version=2)).reason == "too_slow"
        clock.t += 31.0  # re-measured: one more lease, late again, refused again
        again = ctl.lease(w, LeaseRequest(worker_version=2)).lease
        ctl.db.put("next_step", 5)
        ctl.publish(5)
        clock.t += 3.0
        submit_all(ctl, w, again, versions=(2, 2, 2))
        assert ctl.lease(w, LeaseRequest(worker_version=5)).reason == "too_slow"
    said = [r.getMessage() for r in caplog.records if "gets no work" in r.getMessage()]
    assert len(said) == 1 and "billed $2.00/h" in said[0], said
