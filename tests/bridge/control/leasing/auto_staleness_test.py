"""`staleness="auto"`: the rule (auto_staleness.py) and a real controller moving S with it."""

import random

import pytest
from controller_helpers import make, submit_all, worker

from bridge.control.leasing.auto_staleness import AutoStaleness
from bridge.control.protocol import LeaseRequest


def test_a_drop_raises_s_by_one_and_only_new_drops_count():
    auto = AutoStaleness(s_min=0, s_max=3, s=0)
    assert auto.observe(dropped_total=2, data_wait_s=0.0, step_s=1.0, model_staleness=None) == 1
    # The same cumulative count again is no new drop: no further raise.
    assert auto.observe(dropped_total=2, data_wait_s=0.0, step_s=1.0, model_staleness=None) == 1
    assert auto.observe(dropped_total=3, data_wait_s=0.0, step_s=1.0, model_staleness=None) == 2


def test_waiting_raises_to_the_models_s_only_when_the_model_asks_for_more():
    auto = AutoStaleness(s_min=0, s_max=4, s=1)
    # Waiting on a fleet that is merely small (no confident model): S stays.
    assert auto.observe(0, data_wait_s=0.5, step_s=1.0, model_staleness=None) == 1
    assert auto.observe(0, data_wait_s=0.5, step_s=1.0, model_staleness=1) == 1
    # The freshness condition needs 3: straight there.
    assert auto.observe(0, data_wait_s=0.5, step_s=1.0, model_staleness=3) == 3
    # A wait under wait_fraction of the step is no wait.
    assert auto.observe(0, data_wait_s=0.05, step_s=1.0, model_staleness=4) == 3


def test_before_the_model_is_confident_a_wait_raises_s_one_step_toward_its_estimate():
    auto = AutoStaleness(s_min=0, s_max=3, s=0)
    waited = dict(dropped_total=0, data_wait_s=0.5, step_s=1.0, model_staleness=None)
    # No estimate yet, or no wait: nothing moves.
    assert auto.observe(**waited) == 0
    assert auto.observe(0, data_wait_s=0.05, step_s=1.0, model_staleness=None, estimate=2) == 0
    # One step per waited batch, never past the estimate.
    assert [auto.observe(**waited, estimate=2) for _ in range(3)] == [1, 2, 2]
    # Nor past S_max.
    assert [auto.observe(**waited, estimate=9) for _ in range(3)] == [3, 3, 3]
    # Once confident, the model's S rules: down one step after the quiet batches.
    quiet = dict(dropped_total=0, data_wait_s=0.0, step_s=1.0, model_staleness=1)
    assert [auto.observe(**quiet) for _ in range(4)] == [3, 3, 3, 2]


def test_s_comes_down_one_at_a_time_after_quiet_batches_only():
    auto = AutoStaleness(s_min=1, s_max=4, s=4, quiet_batches=3)
    quiet = dict(dropped_total=0, data_wait_s=0.0, step_s=1.0, model_staleness=1)
    assert [auto.observe(**quiet) for _ in range(3)] == [4, 4, 3]
    # A wait resets the quiet stretch.
    assert auto.observe(0, data_wait_s=0.5, step_s=1.0, model_staleness=1) == 3
    assert [auto.observe(**quiet) for _ in range(6)] == [3, 3, 2, 2, 2, 1]
    # Never below S_min, even when the model says 0.
    quiet["model_staleness"] = 0
    assert [auto.observe(**quiet) for _ in range(6)] == [1] * 6


def test_s_never_leaves_its_bounds_whatever_the_evidence():
    rng = random.Random(0)
    for _ in range(200):
        lo = rng.randint(0, 3)
        hi = lo + rng.randint(0, 3)
        auto = AutoStaleness(s_min=lo, s_max=hi, s=rng.randint(lo, hi), quiet_batches=1)
        dropped = 0
        for _ in range(50):
            dropped += rng.choice((0, 0, 1, 5))
            s = auto.observe(
                dropped,
                data_wait_s=rng.choice((0.0, 2.0)),
                step_s=1.0,
                model_staleness=rng.choice((None, 0, 1, 2, 5, 9)),
                estimate=rng.choice((None, 0, 1, 3, 9)),
            )
            assert lo <= s <= hi


@pytest.mark.parametrize("lo, s, hi", [(2, 1, 3), (0, 4, 3), (-1, 0, 2)])
def test_bounds_are_checked(lo, s, hi):
    with pytest.raises(ValueError, match="staleness_min"):
        AutoStaleness(s_min=lo, s_max=hi, s=s)


def test_a_controller_raises_s_after_a_drop_and_admits_with_the_new_s(tmp_path):
    ctl = make(
        tmp_path, staleness=0, staleness_auto=True, staleness_min=0, staleness_max=2,
        groups_per_step=1, max_groups_per_lease=1,
    )  # fmt: skip
    ctl.publish(0)
    w = worker(ctl)
    late = ctl.lease(w, LeaseRequest(worker_version=0, max_groups=1)).lease
    ctl.publish(1)
    submit_all(ctl, w, late, versions=(0, 0, 0))  # version 0 at step 1 with S = 0: stale
    assert ctl.take_batch(1, 1)[0] is None and ctl.stats()["staleness/dropped"] == 1
    # The requeued prompt comes back fresh; the batch that takes it reports the drop.
    again = ctl.lease(w, LeaseRequest(worker_version=1, max_groups=1)).lease
    submit_all(ctl, w, again, versions=(1, 1, 1))
    batch, stats = ctl.wait_batch(1, 1, timeout_s=5.0)
    assert batch is not None and stats["staleness/bound"] == 1
    assert ctl.config.staleness == 1
    # Every part that reads S reads the new one: a version-1 group is fresh at step 2 now.
    for part in (ctl.leasing, ctl.intake, ctl.fleet):
        assert part.config.staleness == 1
    assert ctl.timing.staleness == ctl.learner.staleness == ctl.liveness.staleness == 1
    lease = ctl.lease(w, LeaseRequest(worker_version=1, max_groups=1)).lease
    submit_all(ctl, w, lease, versions=(1, 1, 1))
    batch, stats = ctl.wait_batch(2, 1, timeout_s=5.0)
    assert batch is not None and stats["staleness/max"] == 1


def test_a_fixed_s_reports_no_bound_and_never_moves(tmp_path):
    ctl = make(tmp_path, staleness=0, groups_per_step=1, max_groups_per_lease=1)
    ctl.publish(0)
    w = worker(ctl)
    late = ctl.lease(w, LeaseRequest(worker_version=0, max_groups=1)).lease
    ctl.publish(1)
    submit_all(ctl, w, late, versions=(0, 0, 0))
    assert ctl.take_batch(1, 1)[0] is None
    again = ctl.lease(w, LeaseRequest(worker_version=1, max_groups=1)).lease
    submit_all(ctl, w, again, versions=(1, 1, 1))
    batch, stats = ctl.wait_batch(1, 1, timeout_s=5.0)
    assert batch is not None and "staleness/bound" not in stats and ctl.config.staleness == 0


def test_the_rule_sees_the_learners_whole_wait_for_a_step_across_its_polls(tmp_path):
    # The learner polls wait_batch with short timeouts; the wait that counts is all of them.
    ctl = make(
        tmp_path, staleness=0, staleness_auto=True, staleness_min=0, staleness_max=2,
        groups_per_step=1, max_groups_per_lease=1,
    )  # fmt: skip
    ctl.publish(0)
    w = worker(ctl)
    polls = [ctl.wait_batch(0, 1, timeout_s=0.05)[1]["time/data_wait_s"] for _ in range(3)]
    lease = ctl.lease(w, LeaseRequest(worker_version=0, max_groups=1)).lease
    submit_all(ctl, w, lease, versions=(0, 0, 0))
    batch, stats = ctl.wait_batch(0, 1, timeout_s=5.0)
    assert batch is not None and ctl._step_wait == (0, sum(polls) + stats["time/data_wait_s"])


@pytest.mark.parametrize("quiet_batches, wait_fraction", [(0, 0.1), (2, -0.1)])
def test_the_rules_knobs_are_checked_each_alone(quiet_batches, wait_fraction):
    with pytest.raises(ValueError, match="quiet_batches"):
        AutoStaleness(
            s_min=0, s_max=2, s=1, quiet_batches=quiet_batches, wait_fraction=wait_fraction
        )
    AutoStaleness(s_min=0, s_max=2, s=1, wait_fraction=0.0)  # never waiting counts: allowed


def test_a_wait_is_strictly_more_than_its_fraction_of_a_measured_step():
    auto = AutoStaleness(s_min=0, s_max=4, s=1, wait_fraction=0.1)
    # Exactly the fraction (0.1 * 10.0 == 1.0 in binary floating point) is no wait.
    assert auto.observe(0, data_wait_s=1.0, step_s=10.0, model_staleness=3) == 1
    # Half the fraction is no wait (a rule dividing by the step would call it one).
    assert auto.observe(0, data_wait_s=0.5, step_s=10.0, model_staleness=3) == 1
    # No step measured yet: a wait cannot be judged against it.
    assert auto.observe(0, data_wait_s=5.0, step_s=0.0, model_staleness=3) == 1
    assert auto.observe(0, data_wait_s=1.5, step_s=10.0, model_staleness=3) == 3


def test_the_quiet_stretch_starts_after_a_drop_and_the_models_s_is_not_a_reason_to_fall():
    auto = AutoStaleness(s_min=0, s_max=4, s=2, quiet_batches=4)
    assert auto.observe(1, data_wait_s=0.0, step_s=1.0, model_staleness=0) == 3
    quiet = dict(dropped_total=1, data_wait_s=0.0, step_s=1.0, model_staleness=0)
    assert [auto.observe(**quiet) for _ in range(4)] == [3, 3, 3, 2]
    # The model asking for the current S is no reason to come down, however long it is quiet.
    at_s = dict(quiet, model_staleness=2)
    assert [auto.observe(**at_s) for _ in range(8)] == [2] * 8
