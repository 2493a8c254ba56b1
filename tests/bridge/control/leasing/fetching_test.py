"""A worker fetching the newest version in the background (a relay hop, a WAN download)
keeps working one version behind: its lease is admitted at its own version, so the work
stays within the staleness bound, and every other claim is still "behind"."""

from controller_helpers import make, submit_all, worker

from bridge.control.protocol import LeaseRequest


def test_a_worker_fetching_the_newest_works_one_version_behind_within_the_bound(tmp_path):
    S, g = 2, 2
    ctl = make(tmp_path, staleness=S, groups_per_step=g, max_groups_per_lease=100)
    ctl.publish(0)
    ctl.db.put("next_step", 1)
    ctl.publish(1)
    w, w2 = worker(ctl), worker(ctl)
    assert ctl.lease(w, LeaseRequest(worker_version=0, max_groups=100)).reason == "behind"
    r = ctl.lease(w, LeaseRequest(worker_version=0, max_groups=100, fetching_version=1))
    assert r.swap_to == 1  # still told what to load
    # Admitted at its own version 0, one step staler than the newest: (S + 1 - 1) * g.
    assert ctl.admission_capacity(0) == S * g and ctl.admission_capacity() == (S + 1) * g
    assert len(r.lease.groups) == S * g
    # A worker on the newest gets what version 1 leaves: (S + 1) * g minus what is out.
    r2 = ctl.lease(w2, LeaseRequest(worker_version=1, max_groups=100))
    assert len(r2.lease.groups) == g
    assert submit_all(ctl, w, r.lease, versions=(0, 0, 0)).accepted
    assert submit_all(ctl, w2, r2.lease, versions=(1, 1, 1)).accepted
    for step in (1, 2, 3):  # version 0 first (staleness 1, then 2), then version 1 (2)
        batch, stats = ctl.take_batch(step, g)
        assert batch is not None and stats["staleness/max"] <= S, stats
    assert ctl.stats()["staleness/dropped"] == 0
    # Only the newest may be fetched this way: two behind is behind, and so is a claim
    # about another version.
    ctl.publish(3)
    assert ctl.lease(w, LeaseRequest(worker_version=1, fetching_version=3)).reason == "behind"
    assert ctl.lease(w, LeaseRequest(worker_version=2, fetching_version=1)).reason == "behind"
    assert ctl.lease(w, LeaseRequest(worker_version=2, fetching_version=3)).lease is not None
