"""learner_jax/rl/serve.py `end_run`: the run's end with and without telling the workers
(`controller.tell_run_over`), and what a standing worker meets at the next run: a fresh
controller on its own database (bench/staleness_sweep.py's cells). Real controllers on
SQLite files with an injected clock (tests/controller_helpers.py)."""

import pytest
from controller_helpers import make, submit_all, worker

from bridge.control.intake.validation import SubmissionError
from bridge.control.protocol import Heartbeat, LeaseRequest
from learner_jax.rl import serve


def leased(ctl, version):
    wid = worker(ctl)
    r = ctl.lease(wid, LeaseRequest(worker_version=version, max_groups=1))
    assert r.lease is not None, r
    return wid, r.lease


@pytest.mark.parametrize("tell", [True, False])
def test_end_run_tells_the_workers_only_when_asked(tmp_path, tell):
    ctl = make(tmp_path)
    ctl.publish(0)
    wid, _ = leased(ctl, 0)
    serve.end_run(ctl, "finished", tell=tell, drain_s=0.0)
    assert ctl.heartbeat(wid, Heartbeat(worker_version=0)).run_over is tell
    reason = ctl.lease(wid, LeaseRequest(worker_version=0, max_groups=1)).reason
    assert (reason == "run_over") is tell
    if tell:  # the one worker polled and heard it: the drain is over at once
        assert serve.end_run(ctl, "finished", tell=True, drain_s=0.0)


def test_a_standing_worker_meets_the_next_run_as_a_stranger(tmp_path):
    # Run 1 ends untold, its worker holding a lease at version 7; run 2 is a fresh
    # controller (its own database) publishing the warm start again, version 5. (The HTTP
    # layer refuses the old token with a 401 and the worker registers again: session.py.)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    one = make(tmp_path / "a")
    one.publish(5), one.publish(7)
    _, old = leased(one, 7)
    serve.end_run(one, "finished", tell=False)
    one.close()
    two = make(tmp_path / "b")
    two.publish(5)
    wid = worker(two)
    with pytest.raises(SubmissionError, match="unknown lease"):  # the old run's work
        submit_all(two, wid, old, versions=(5, 5, 5))
    # the version it still serves, from the old run, is sent back to the new run's ...
    assert two.heartbeat(wid, Heartbeat(worker_version=7)).swap_to == 5
    r = two.lease(wid, LeaseRequest(worker_version=7, max_groups=1))
    assert r.swap_to == 5
    with pytest.raises(SubmissionError, match="from the future"):  # ... and never trained on
        submit_all(two, wid, r.lease, versions=(7, 7, 7))
    r = two.lease(wid, LeaseRequest(worker_version=5, max_groups=1))
    assert submit_all(two, wid, r.lease, versions=(5, 5, 5)).accepted
