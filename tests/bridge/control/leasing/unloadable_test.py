"""A newest version the workers cannot load (corrupt in the store) does not stall the run:
a worker that reports it keeps getting work on the version before, within the staleness
bound, until the learner publishes the next one."""

import logging

from controller_helpers import make, submit_all, worker

from bridge.control.protocol import Heartbeat, LeaseRequest


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


def test_a_stalled_fleet_asks_for_the_version_again_and_says_no_work_is_admissible(
    tmp_path, caplog
):
    """The stall: S = 2 and versions 1 and 2 corrupt, the worker still on 0 (two behind, one
    forgiven: behind), and a fresh worker with nothing loaded (it reports in heartbeats).
    The controller asks the learner for 2 again, says no work is admissible, and both end
    when 2 is announced again (in the log once, when it starts, and once when it ends); the
    learner's step resets the stall clock."""
    now = [1000.0]
    ctl = make(tmp_path, clock=lambda: now[0], staleness=2, groups_per_step=1)
    ctl.publish(0)
    old, fresh = worker(ctl), worker(ctl)
    ctl.publish(1)
    ctl.publish(2)
    assert ctl.unloadable_version() == -1 and ctl.stats()["fleet/no_admissible_work"] == 0
    assert ctl.lease(old, LeaseRequest(worker_version=0, unloadable_version=2)).reason == "behind"
    assert ctl.unloadable_version() == 2
    assert ctl.stats()["fleet/no_admissible_work"] == 0  # the fresh worker may still load 2
    ctl.heartbeat(fresh, Heartbeat(worker_version=-1, unloadable_version=2))
    now[0] += 30.0
    caplog.set_level(logging.INFO)
    stats = ctl.stats()
    assert stats["fleet/no_admissible_work"] == 1
    assert stats["learner/since_last_step_s"] == 30.0
    assert ctl.stats()["fleet/no_admissible_work"] == 1  # every stats line while it lasts
    said = [r for r in caplog.records if "no admissible work" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING, said
    assert "cannot load version 2" in said[0].getMessage()
    ctl.publish(2)  # the learner's new copy
    assert ctl.unloadable_version() == -1
    # The workers' claims are about the old copy until they try the new one.
    ctl.heartbeat(fresh, Heartbeat(worker_version=2))
    assert ctl.lease(old, LeaseRequest(worker_version=0)).swap_to == 2
    assert ctl.stats()["fleet/no_admissible_work"] == 0
    assert any("admissible work again" in r.getMessage() for r in caplog.records)
    ctl.report_learner(0.1)
    assert ctl.stats()["learner/since_last_step_s"] == 0.0
