"""A newest version the workers cannot load (corrupt in the store) does not stall the run:
a worker that reports it keeps getting work on the version before, within the staleness
bound, until the learner publishes the next one."""

from controller_helpers import make, submit_all, worker

from bridge.control.protocol import LeaseRequest


def test_a_reported_unloadable_newest_version_is_not_behind(tmp_path):
    ctl = make(tmp_path, staleness=2, groups_per_step=1)
    ctl.publish(4)
    ctl.publish(5)  # the store's copy of 5 is corrupt: the worker stays at 4
    w = worker(ctl)
    assert ctl.lease(w, LeaseRequest(worker_version=4)).reason == "behind"
    r = ctl.lease(w, LeaseRequest(worker_version=4, unloadable_version=5))
    assert r.lease is not None and r.swap_to == 5  # still told what to load
    # Its work is checked like any other: version 4 is fresh for the learner's next step.
    assert submit_all(ctl, w, r.lease, versions=(4, 4, 4)).accepted
    # Only the newest may be skipped this way: two behind is behind, and so is a claim
    # about another version.
    assert ctl.lease(w, LeaseRequest(worker_version=3, unloadable_version=5)).reason == "behind"
    assert ctl.lease(w, LeaseRequest(worker_version=4, unloadable_version=3)).reason == "behind"
    ctl.publish(6)
    assert ctl.lease(w, LeaseRequest(worker_version=4, unloadable_version=5)).reason == "behind"
