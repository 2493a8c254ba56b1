"""Controller logic on a real SQLite file with an injected clock: leases, idempotent
submissions, staleness drops, admission control, restarts, fleet accounting. Too-slow
workers: too_slow_test.py; helpers: tests/controller_helpers.py."""

import json
import math
import threading
import time

import pytest
from controller_helpers import Clock, dump, make, result, submit_all, worker

from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.intake.validation import SubmissionError
from bridge.control.protocol import (
    Heartbeat,
    LeaseRequest,
    Submission,
    WorkerProfile,
)
from bridge.tasks import make_task


def test_no_work_before_a_version_is_published(tmp_path):
    ctl = make(tmp_path)
    r = ctl.lease(worker(ctl), LeaseRequest(worker_version=-1, max_groups=2))
    assert r.lease is None and r.reason == "no_version"


def test_lease_expires_and_requeues_heartbeat_renews(tmp_path):
    clock = Clock()
    ctl = make(tmp_path, clock, staleness=0)  # room for exactly one lease of 2 groups
    ctl.publish(0, {"root": "mem"})
    a, b = worker(ctl), worker(ctl)
    la = ctl.lease(a, LeaseRequest(worker_version=0, max_groups=2)).lease
    assert len(la.groups) == 2 and la.groups[0].n == 2 and la.groups[0].task == "arithmetic"
    assert ctl.lease(b, LeaseRequest(worker_version=0, max_groups=2)).reason == "full"
    clock.t += 8
    hb = ctl.heartbeat(a, Heartbeat(worker_version=0))
    assert hb.renewed_leases == [la.lease_id] and hb.announcement.store == {"root": "mem"}
    clock.t += 8  # 16 s after issue but only 8 after the renewal: still held
    assert ctl.lease(b, LeaseRequest(worker_version=0, max_groups=2)).reason == "full"
    clock.t += 3
    lb = ctl.lease(b, LeaseRequest(worker_version=0, max_groups=2)).lease
    # The same prompts come back first, to the other worker.
    assert [g.group_id for g in lb.groups] == [g.group_id for g in la.groups]
    assert ctl.stats()["leases/expired"] == 1
    with pytest.raises(SubmissionError, match="no longer") as e:
        submit_all(ctl, a, la)
    assert e.value.status == 409
    with pytest.raises(SubmissionError, match="another worker") as e:
        submit_all(ctl, a, lb)
    assert e.value.status == 403
    assert submit_all(ctl, b, lb).accepted == [g.group_id for g in lb.groups]


def test_submission_is_idempotent_and_batch_is_in_arrival_order_within_a_version(tmp_path):
    ctl = make(tmp_path)
    ctl.publish(0)
    w = worker(ctl)
    lease = ctl.lease(w, LeaseRequest(worker_version=0, max_groups=2)).lease
    first = ctl.submit(w, Submission(lease_id=lease.lease_id, groups=[result(lease.groups[0])]))
    assert first.accepted == [lease.groups[0].group_id] and first.duplicates == []
    again = submit_all(ctl, w, lease)
    assert again.accepted == [lease.groups[1].group_id]
    assert again.duplicates == [lease.groups[0].group_id]
    before = dump(ctl)
    third = submit_all(ctl, w, lease)
    assert third.accepted == [] and len(third.duplicates) == 2
    stats = ctl.stats()
    assert stats["groups/accepted"] == 2 and stats["trajectories/accepted"] == 4
    assert [x for x in dump(ctl) if "groups/duplicate" not in x] == [
        x for x in before if "groups/duplicate" not in x
    ]
    batch, stats = ctl.take_batch(0, 2)
    assert [g.group_id for g in batch] == [g.group_id for g in lease.groups]
    assert batch[0].trajectories[1].completion_token_ids == [11, 11, 11]
    assert stats["staleness/mean"] == 0 and stats["staleness/max"] == 0
    assert ctl.take_batch(1, 1)[0] is None  # consumed groups never come back


@pytest.mark.parametrize(
    "override, match",
    [
        (dict(completion_token_ids=[10, 100, 2]), "outside the vocabulary"),
        (dict(prompt_token_ids=[-1, 5, 6]), "differ from the leased prompt"),
        (dict(logprobs=[-0.5, math.nan, -1.0]), "not finite"),
        (dict(logprobs=[-0.5, 0.1, -1.0]), "<= 0"),
        (dict(logprobs=[-0.5, -math.inf, -1.0]), "not finite"),
        (dict(versions=[0, 1, 1]), "from the future"),
        (dict(logprobs=[-0.5, -0.5]), "one logprob and one version"),
        (dict(versions=[1, 0, 0]), "from the future"),
        (dict(completion_token_ids=[3] * 5, logprobs=[-1.0] * 5, versions=[0] * 5), "max_tokens"),
        (dict(prompt_id="other"), "prompt_id"),
        (dict(sample_index=0), "sample_index"),
        (dict(prompt_token_ids=[]), "prompt has 0 tokens"),
    ],
)
def test_bad_submissions_are_refused_and_change_nothing(tmp_path, override, match):
    ctl = make(tmp_path)
    ctl.publish(0)
    w = worker(ctl)
    lease = ctl.lease(w, LeaseRequest(worker_version=0, max_groups=2)).lease
    good = result(lease.groups[0])
    bad = result(lease.groups[1], **override)
    before = dump(ctl)
    with pytest.raises(SubmissionError, match=match) as e:
        ctl.submit(w, Submission.model_construct(lease_id=lease.lease_id, groups=[good, bad]))
    assert e.value.status == 422
    assert dump(ctl) == before  # the good group in the same request was not accepted either


def test_incomplete_group_and_unknown_lease(tmp_path):
    ctl = make(tmp_path)
    ctl.publish(0)
    w = worker(ctl)
    lease = ctl.lease(w, LeaseRequest(worker_version=0, max_groups=1)).lease
    short = result(lease.groups[0], n=1)
    with pytest.raises(SubmissionError, match="incomplete"):
        ctl.submit(w, Submission.model_construct(lease_id=lease.lease_id, groups=[short]))
    with pytest.raises(SubmissionError, match="unknown lease") as e:
        ctl.submit(w, Submission.model_construct(lease_id="nope", groups=[short]))
    assert e.value.status == 404


def test_stale_groups_are_dropped_counted_and_requeued(tmp_path):
    ctl = make(tmp_path, staleness=1, groups_per_step=1, max_groups_per_lease=1)
    ctl.publish(0)
    w = worker(ctl)
    old = ctl.lease(w, LeaseRequest(worker_version=0, max_groups=1)).lease
    ctl.publish(1)
    submit_all(ctl, w, old, versions=(0, 1, 1))  # swapped mid-generation
    # Step 1 accepts version 0 (1 - 0 <= S); it is consumed with staleness 1.
    batch, stats = ctl.take_batch(1, 1)
    assert stats["staleness/max"] == 1 and stats["staleness/dropped"] == 0
    l2 = ctl.lease(w, LeaseRequest(worker_version=1, max_groups=1)).lease
    ctl.publish(2)
    submit_all(ctl, w, l2, versions=(1, 2, 2))  # oldest token 1 (the lease's version)
    (held,) = [json.loads(r["payload"]) for r in ctl.db.groups_in("buffered")]
    batch, stats = ctl.take_batch(3, 1)  # 3 - 1 > S: dropped, prompt requeued
    assert batch is None and stats["staleness/dropped"] == 1 and stats["groups/buffered"] == 0
    # What was dropped stays on record though the requeue cleared the group's payload.
    (gone,) = ctl.db.dropped_groups()
    assert (gone["prompt_id"], gone["step"], gone["min_version"], gone["worker_id"]) == (
        l2.groups[0].prompt_id, 3, 1, w,
    )  # fmt: skip
    assert json.loads(gone["lengths"]) == [len(t["completion_token_ids"]) for t in held]
    assert json.loads(gone["rewards"]) == [t["reward"] for t in held]
    ctl.publish(3)
    again = ctl.lease(w, LeaseRequest(worker_version=3, max_groups=1)).lease
    assert again.groups[0].prompt_id == l2.groups[0].prompt_id
    submit_all(ctl, w, again, versions=(3, 3, 3))
    batch, stats = ctl.take_batch(3, 1)
    assert batch[0].prompt_id == l2.groups[0].prompt_id and stats["staleness/max"] == 0


def test_admission_control_and_swap_instruction(tmp_path):
    S, g = 2, 2
    ctl = make(tmp_path, staleness=S, groups_per_step=g, max_groups_per_lease=100)
    ctl.publish(0, {"root": "v0"})
    w = worker(ctl)
    assert ctl.admission_capacity() == (S + 1) * g
    lease = ctl.lease(w, LeaseRequest(worker_version=0, max_groups=100)).lease
    assert len(lease.groups) == (S + 1) * g
    assert ctl.lease(w, LeaseRequest(worker_version=0, max_groups=1)).reason == "full"
    submit_all(ctl, w, lease)
    assert ctl.lease(w, LeaseRequest(worker_version=0, max_groups=1)).reason == "full"
    ctl.take_batch(0, g)
    ctl.take_batch(1, g)
    # Learner at step 2, newest version still 0: only (S + 1 - 2) * g may be out.
    assert ctl.admission_capacity() == g
    assert ctl.lease(w, LeaseRequest(worker_version=0, max_groups=1)).reason == "full"
    ctl.publish(2, {"root": "v2"})
    r = ctl.lease(w, LeaseRequest(worker_version=0, max_groups=1))
    assert r.lease is None and r.reason == "behind" and r.swap_to == 2
    assert r.announcement.store == {"root": "v2"}
    assert ctl.heartbeat(w, Heartbeat(worker_version=0)).swap_to == 2
    assert ctl.heartbeat(w, Heartbeat(worker_version=2)).swap_to is None
    r = ctl.lease(w, LeaseRequest(worker_version=2, max_groups=100))
    assert len(r.lease.groups) == (S + 1) * g - g and r.swap_to is None  # g still buffered
    # Every group leased under admission control is fresh when the learner gets to it.
    submit_all(ctl, w, r.lease, versions=(2, 2, 2))
    for step in (2, 3, 4):
        batch, stats = ctl.take_batch(step, g)
        assert batch is not None and stats["staleness/max"] <= S
    assert ctl.stats()["staleness/dropped"] == 0


def test_worker_concurrency_cap_and_inactive_workers(tmp_path):
    ctl = make(tmp_path, groups_per_step=10, group_size=4)
    ctl.publish(0)
    w = worker(ctl, max_seqs=8)  # 8 sequences = 2 groups of 4
    assert len(ctl.lease(w, LeaseRequest(worker_version=0, max_groups=5)).lease.groups) == 2
    assert ctl.lease(w, LeaseRequest(worker_version=0, max_groups=5)).reason == "full"
    other = worker(ctl)
    ctl.set_worker_enabled(other, False)
    assert ctl.lease(other, LeaseRequest(worker_version=0)).reason == "inactive"
    assert ctl.heartbeat(other, Heartbeat(worker_version=0)).active is False


def test_restart_loses_nothing_and_consumes_nothing_twice(tmp_path):
    ctl = make(tmp_path, staleness=3, groups_per_step=2)
    ctl.publish(0)
    w = worker(ctl)
    accepted = []
    lease = ctl.lease(w, LeaseRequest(worker_version=0, max_groups=8)).lease
    accepted += submit_all(ctl, w, lease).accepted
    assert len(accepted) == 8
    consumed = {}
    batch, _ = ctl.take_batch(0, 2)
    consumed[0] = [g.group_id for g in batch]
    checkpoint = ctl.export_cursor()  # the learner checkpoints after step 0
    batch, _ = ctl.take_batch(1, 2)  # consumed at step 1, but the learner dies before saving
    lost_step = [g.group_id for g in batch]
    ctl.close()

    ctl = make(tmp_path, staleness=3, groups_per_step=2)
    assert ctl.authenticate("bogus") is None
    assert ctl.restore_cursor(checkpoint) == 2
    for step in (1, 2, 3):
        batch, _ = ctl.take_batch(step, 2)
        consumed[step] = [g.group_id for g in batch]
        if step == 2:  # a clean restart between steps, with the cursor saved at step 2
            cursor = ctl.export_cursor()
            ctl.close()
            ctl = make(tmp_path, staleness=3, groups_per_step=2)
            assert ctl.restore_cursor(cursor) == 0
    assert consumed[1] == lost_step  # redone after the restore, in the same order
    flat = [gid for step in sorted(consumed) for gid in consumed[step]]
    assert sorted(flat) == sorted(accepted) and len(set(flat)) == len(flat)
    assert ctl.take_batch(4, 1)[0] is None
    # Submitting again after the restart is still recognized as a duplicate.
    assert len(submit_all(ctl, w, lease).duplicates) == 8
    # Prompts continue where they left off instead of repeating.
    ctl.publish(4)
    new = ctl.lease(w, LeaseRequest(worker_version=4, max_groups=1)).lease
    assert new.groups[0].prompt_id not in {g.prompt_id for g in lease.groups}
    assert ctl.forget_consumed(3) == 8


def test_leave_requeues_and_revokes(tmp_path):
    ctl = make(tmp_path)
    ctl.publish(0)
    w, token = ctl.register(
        WorkerProfile(accelerator="cpu", price_per_hour=1.0, max_concurrent_sequences=4)
    )
    assert ctl.authenticate(token) == w
    lease = ctl.lease(w, LeaseRequest(worker_version=0, max_groups=2)).lease
    ctl.leave(w)
    assert ctl.authenticate(token) is None
    s = ctl.stats()
    assert s["groups/queued"] == len(lease.groups) and s["groups/leased"] == 0


def test_fleet_stats_and_cost(tmp_path):
    clock = Clock()
    ctl = make(tmp_path, clock, worker_timeout_s=30.0)
    a, b = worker(ctl, price=3.6), worker(ctl, price=36.0)
    for _ in range(10):  # a: 10 heartbeats 10 s apart = 100 s alive
        clock.t += 10
        ctl.heartbeat(a, Heartbeat(worker_version=-1, samples_per_s=5.0))
    clock.t += 1000  # b was silent for longer than the timeout: not billed, not active
    ctl.heartbeat(b, Heartbeat(worker_version=-1, samples_per_s=7.0))
    s = ctl.stats()
    assert s["cost/usd"] == pytest.approx(3.6 * 100 / 3600)
    assert s["fleet/active_workers"] == 1 and s["fleet/rollouts_per_s"] == 7.0


def test_worker_versions_lists_every_worker_with_price_and_join_time(tmp_path):
    clock = Clock()
    ctl = make(tmp_path, clock)
    a = worker(ctl, price=3.6)
    clock.t += 5
    b = worker(ctl, price=0.5)
    clock.t += 5
    ctl.heartbeat(a, Heartbeat(worker_version=2))
    ctl.leave(b)  # one that left is still listed: its swaps happened
    got = sorted(ctl.worker_versions(), key=lambda w: w["registered_at"])
    assert got == [
        {"worker_id": a, "version": 2, "price_per_hour": 3.6, "registered_at": 1000.0},
        {"worker_id": b, "version": -1, "price_per_hour": 0.5, "registered_at": 1005.0},
    ]


def test_wait_batch_wakes_on_submission(tmp_path):
    ctl = make(tmp_path, groups_per_step=1)
    ctl.publish(0)
    w = worker(ctl)
    lease = ctl.lease(w, LeaseRequest(worker_version=0, max_groups=1)).lease
    timer = threading.Timer(0.2, submit_all, args=(ctl, w, lease))
    timer.start()
    t0 = time.monotonic()
    batch, stats = ctl.wait_batch(0, 1, timeout_s=10.0)
    took = time.monotonic() - t0
    timer.join()
    assert [g.group_id for g in batch] == [lease.groups[0].group_id]
    # It waited for the submission (unless the box stalled past the timer), and says how long:
    # the part of the call with no batch, not the learner's own time in the capacity model.
    assert 0.0 <= stats["time/data_wait_s"] <= took
    batch, stats = ctl.wait_batch(1, 1, timeout_s=0.1)
    assert batch is None and stats["time/data_wait_s"] > 0.0
    # A batch already there: no wait at all.
    lease = ctl.lease(w, LeaseRequest(worker_version=0, max_groups=1)).lease
    submit_all(ctl, w, lease)
    batch, stats = ctl.wait_batch(1, 1, timeout_s=10.0)
    assert batch is not None and stats["time/data_wait_s"] == 0.0


def test_a_broken_task_fails_at_startup(tmp_path):
    with pytest.raises(FileNotFoundError):
        Controller(
            ControllerConfig(),
            str(tmp_path / "c.db"),
            make_task("gsm8k", path=str(tmp_path / "missing.jsonl")),
        )


def test_batches_take_the_oldest_version_first(tmp_path):
    # Consumed in arrival order, the slow worker's version-0 group would wait behind the
    # fast worker's version-1 group and be dropped at step 2 (2 - 0 > S = 1).
    ctl = make(tmp_path, staleness=1, groups_per_step=1, max_groups_per_lease=1)
    ctl.publish(0)
    slow, fast = worker(ctl), worker(ctl)
    old = ctl.lease(slow, LeaseRequest(worker_version=0)).lease
    assert ctl.take_batch(0, 1)[0] is None  # the learner is at step 1 once it has a batch
    ctl.db.put("next_step", 1)
    ctl.publish(1)
    new = ctl.lease(fast, LeaseRequest(worker_version=1)).lease
    submit_all(ctl, fast, new, versions=(1, 1, 1))
    submit_all(ctl, slow, old, versions=(0, 0, 0))  # arrives last
    b1, _ = ctl.take_batch(1, 1)
    b2, stats = ctl.take_batch(2, 1)
    assert [b1[0].group_id, b2[0].group_id] == [old.groups[0].group_id, new.groups[0].group_id]
    assert stats["staleness/dropped"] == 0 and stats["staleness/max"] == 1


def test_a_resumed_run_does_not_inherit_the_old_runs_end(tmp_path):
    ctl = make(tmp_path)
    ctl.publish(0)
    wid = worker(ctl)
    ctl.end_run("interrupted")
    assert ctl.heartbeat(wid, Heartbeat(worker_version=0)).run_over
    ctl.close()
    # The rerun opens the same database: its workers must not be sent home.
    ctl = make(tmp_path)
    assert not ctl.heartbeat(wid, Heartbeat(worker_version=0)).run_over
    assert ctl.lease(wid, LeaseRequest(worker_version=0, max_groups=1)).reason != "run_over"


def test_a_worker_ahead_of_the_newest_version_is_sent_back(tmp_path):
    # After a learner crash the rerun republishes from its checkpoint: a worker still holding
    # a rolled-back version must load the republished lineage, not keep its old weights.
    ctl = make(tmp_path)
    wid = worker(ctl)
    assert ctl.heartbeat(wid, Heartbeat(worker_version=7)).swap_to is None  # nothing published
    ctl.publish(5)
    assert ctl.heartbeat(wid, Heartbeat(worker_version=7)).swap_to == 5
    assert ctl.heartbeat(wid, Heartbeat(worker_version=4)).swap_to == 5
    assert ctl.heartbeat(wid, Heartbeat(worker_version=5)).swap_to is None
