"""The SQL work of a lease and a submission does not grow with the fleet.

Counted, not timed: SQLite's progress handler called on every virtual-machine instruction
of the controller's connections (the writer and the calling thread's read-only one) while
one lease grant, one "full" refusal and one submission run, in a fleet of a few workers and
in one of many, each worker holding a lease. A statement that walks every active lease or
every leased group (the worker's held groups through a join from all leased groups, its
active leases through the state index, COUNT(*) of each state) costs at least one
instruction per row it visits, so the larger fleet would add at least one instruction per
added worker; the bound below is less than that. The count does not depend on the
machine's speed or load.
"""

from controller_helpers import make, submit_all, worker

from bridge.control.protocol import LeaseRequest

SMALL, LARGE = 8, 160


def _work(tmp_path, fleet: int) -> dict[str, int]:
    """VM instructions of a grant, a submission and a "full" refusal with `fleet` other
    workers each holding a one-group lease."""
    tmp_path.mkdir()
    # hot_flush_s=0: no flusher thread writing on the connection while we count.
    ctl = make(tmp_path, groups_per_step=fleet, hot_flush_s=0.0, max_groups_per_lease=1)
    ctl.publish(0)
    one = LeaseRequest(worker_version=0, max_groups=1)
    for _ in range(fleet):
        assert ctl.lease(worker(ctl), one).lease is not None
    me, other = worker(ctl), worker(ctl)
    count = [0]

    def tick():
        count[0] += 1
        return 0  # go on

    def counted(call):
        count[0] = 0
        for conn in (ctl.db.conn, ctl.db.reader()):
            conn.set_progress_handler(tick, 1)
        try:
            out = call()
        finally:
            for conn in (ctl.db.conn, ctl.db.reader()):
                conn.set_progress_handler(None, 1)
        return out, count[0]

    work = {}
    reply, work["grant"] = counted(lambda: ctl.lease(me, one))
    assert reply.lease is not None
    reply, work["submit"] = counted(lambda: submit_all(ctl, me, reply.lease))
    assert len(reply.accepted) == 1
    while (r := ctl.lease(worker(ctl), one)).lease is not None:  # fill the admission
        pass
    assert r.reason == "full", r
    reply, work["full"] = counted(lambda: ctl.lease(other, one))
    assert reply.reason == "full", reply
    ctl.close()
    return work


def test_a_lease_and_a_submission_do_not_read_more_rows_in_a_larger_fleet(tmp_path):
    small = _work(tmp_path / "small", SMALL)
    large = _work(tmp_path / "large", LARGE)
    for op in small:
        assert small[op] > 0, (op, small)
        # Less than one instruction per added worker: no statement walks the fleet.
        assert large[op] - small[op] < LARGE - SMALL, (op, small, large)
