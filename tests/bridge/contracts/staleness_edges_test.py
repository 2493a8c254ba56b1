"""The staleness rule's arithmetic (bridge/contracts/staleness.py) on hand-checked values:
the edges that the controller/simulator agreement test does not reach (a capacity that
would go negative, the lease deadline, the publish schedule's bound)."""

from bridge.contracts import staleness


def test_version_is_usable_for_exactly_s_plus_one_steps():
    S = 2
    assert [t for t in range(3, 10) if staleness.is_fresh(3, t, S)] == [3, 4, 5]
    assert staleness.oldest_fresh(5, S) == 3
    assert staleness.batches_left(3, 5, S) == 1 and staleness.batches_left(3, 6, S) == 0


def test_admission_capacity_is_never_negative():
    # Version 0 at step 10 with S = 2 is 8 steps too old: batches_left is -7.
    assert staleness.admission_capacity(0, 10, 2, 4) == 0
    assert not staleness.admits(0, 0, 10, 2, 4)
    assert staleness.admission_capacity(3, 4, 2, 4) == 8  # two batches left of 4 groups
    assert staleness.admits(7, 3, 4, 2, 4) and not staleness.admits(8, 3, 4, 2, 4)


def test_lease_window():
    # Version 5 at next step 6 with S = 2: steps 6 and 7 may still use it, one batch per
    # 10 s, and 3 s of the first period are gone.
    assert staleness.lease_window_s(5, 6, 2, 10.0, 3.0) == 17.0
    assert staleness.lease_window_s(5, 8, 2, 10.0, 3.0) == -3.0  # already too late


def test_schedule_bound():
    assert staleness.min_staleness(4) == 3 and staleness.min_staleness(1) == 0
    assert staleness.schedule_error(3, 4) is None
    assert staleness.schedule_error(2, 4).endswith(
        "wait forever for versions that are never published"
    )
    # Each bad argument alone is refused, also when the other check would pass.
    assert "publish_every >= 1" in staleness.schedule_error(0, 0)
    assert "staleness >= 0" in staleness.schedule_error(-1, 1)
