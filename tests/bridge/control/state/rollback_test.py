"""A rerun after kill -9 resumes from its checkpoint: what the crashed run did past it is
rolled back (bridge/control/state/rollback.py), and nothing accepted that is still valid is lost."""

from controller_helpers import make, submit_all, worker

from bridge.control.protocol import Heartbeat, LeaseRequest


def test_rerun_keeps_valid_groups_and_requeues_rolled_back_ones(tmp_path):
    ctl = make(tmp_path, staleness=3, groups_per_step=2)
    ctl.publish(0)
    w, late = worker(ctl), worker(ctl)
    old = ctl.lease(w, LeaseRequest(worker_version=0, max_groups=4)).lease
    assert len(submit_all(ctl, w, old, versions=(0, 0, 0)).accepted) == 4
    batch, _ = ctl.take_batch(0, 2)  # step 0: the checkpoint holds version 1 after it
    checkpoint = ctl.export_cursor()
    ctl.publish(1)
    mixed = ctl.lease(w, LeaseRequest(worker_version=1, max_groups=2)).lease
    ctl.publish(2)  # published after the checkpoint: the rerun will not have these weights
    assert len(submit_all(ctl, w, mixed, versions=(1, 2, 2)).accepted) == 2
    consumed_after = [g.group_id for g in ctl.take_batch(1, 2)[0]]  # lost with the crash
    held = ctl.lease(late, LeaseRequest(worker_version=2, max_groups=1)).lease
    ctl.close()

    ctl = make(tmp_path, staleness=3, groups_per_step=2)
    assert ctl.restore_cursor(checkpoint, version=1) == 2
    rows = {r["group_id"]: r for r in ctl.db.q("SELECT * FROM groups")}
    valid = {g.group_id for g in old.groups} - {g.group_id for g in batch}
    # The two consumed after the checkpoint (version 0) are back in the buffer; the two
    # with tokens from version 2 are queued again, as is the group leased at version 2.
    assert set(consumed_after) <= valid
    assert {g for g, r in rows.items() if r["state"] == "buffered"} == valid
    assert {rows[g.group_id]["state"] for g in mixed.groups} == {"queued"}
    assert rows[held.groups[0].group_id]["state"] == "queued"
    assert ctl.db.lease(held.lease_id)["state"] == "rolled_back"
    assert ctl.db.get("groups/rolled_back") == 2
    # The rerun announces version 1 again and the worker that served 2 is sent back to it.
    assert ctl.announcement().version == -1
    ctl.publish(1)
    assert ctl.heartbeat(late, Heartbeat(worker_version=2)).swap_to == 1
    got = [g.group_id for g in ctl.take_batch(1, 2)[0]]
    assert sorted(got) == sorted(valid)


def test_a_checkpoint_at_the_newest_version_rolls_back_nothing(tmp_path):
    ctl = make(tmp_path, staleness=3, groups_per_step=2)
    ctl.publish(0)
    w = worker(ctl)
    lease = ctl.lease(w, LeaseRequest(worker_version=0, max_groups=2)).lease
    submit_all(ctl, w, lease)
    cursor = ctl.export_cursor()
    ctl.close()
    ctl = make(tmp_path, staleness=3, groups_per_step=2)
    assert ctl.restore_cursor(cursor, version=0) == 0
    assert ctl.announcement().version == 0 and ctl.db.count("buffered") == 2
    assert ctl.db.lease(lease.lease_id)["state"] != "rolled_back"


def test_a_lease_taken_at_a_rolled_back_version_ends_though_the_kill_lost_the_worker_row(
    tmp_path,
):
    """A binary killed right after granting a lease at version 2: the worker's version lived
    in the controller's memory (hot state), so the database's row never said 2. The rerun
    from checkpoint 1 must still end that lease, by the version it was taken at: kept, its
    worker's heartbeats renewed it although the worker had given it up, and it held the
    rerun's admission full (a chaos soak hang)."""
    killed = make(tmp_path, staleness=3, groups_per_step=2)
    killed.publish(0)
    w = worker(killed)
    checkpoint = killed.export_cursor()
    killed.publish(1)
    killed.publish(2)
    held = killed.lease(w, LeaseRequest(worker_version=2, max_groups=1)).lease
    assert killed.db.q("SELECT version FROM workers")[0]["version"] < 2  # not on disk

    ctl = make(tmp_path, staleness=3, groups_per_step=2)  # the rerun; `killed` never closed
    try:
        ctl.restore_cursor(checkpoint, version=1)
        assert ctl.db.lease(held.lease_id)["state"] == "rolled_back"
        (row,) = ctl.db.q("SELECT state FROM groups WHERE group_id=?", (held.groups[0].group_id,))
        assert row["state"] == "queued"
    finally:
        ctl.close()
