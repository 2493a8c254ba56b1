"""`staleness="auto"`: the rule (auto_staleness.py) and a real controller moving S with it."""

import random

import pytest
from controller_helpers import make, submit_all, worker

from bridge.control.leasing.auto_staleness import AutoStaleness, KlReport
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
        auto = AutoStaleness(
            s_min=lo, s_max=hi, s=rng.randint(lo, hi), quiet_batches=1,
            kl_max=rng.choice((0.0, 0.01)),
        )  # fmt: skip
        dropped = 0
        for _ in range(50):
            dropped += rng.choice((0, 0, 1, 5))
            kl = KlReport(rng.choice((0.0, 1e-4, 0.05)), rng.uniform(0, hi), rng.randint(lo, hi))
            s = auto.observe(
                dropped,
                data_wait_s=rng.choice((0.0, 2.0)),
                step_s=1.0,
                model_staleness=rng.choice((None, 0, 1, 2, 5, 9)),
                estimate=rng.choice((None, 0, 1, 3, 9)),
                kl=rng.choice((None, kl)),
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


@pytest.mark.parametrize(
    "quiet_batches, wait_fraction, kl_max", [(0, 0.1, 0.0), (2, -0.1, 0.0), (2, 0.1, -0.01)]
)
def test_the_rules_knobs_are_checked_each_alone(quiet_batches, wait_fraction, kl_max):
    with pytest.raises(ValueError, match="quiet_batches"):
        AutoStaleness(
            s_min=0, s_max=2, s=1, quiet_batches=quiet_batches, wait_fraction=wait_fraction,
            kl_max=kl_max,
        )  # fmt: skip
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


# -- the KL ceiling ---------------------------------------------------------------------------
WAITED = dict(dropped_total=0, data_wait_s=0.5, step_s=1.0)
QUIET = dict(dropped_total=0, data_wait_s=0.0, step_s=1.0)


def test_a_batch_past_the_kl_ceiling_steps_s_below_the_s_it_was_taken_under_even_after_a_drop():
    auto = AutoStaleness(s_min=0, s_max=4, s=3, kl_max=0.01)
    # The batch taken under S = 3 measured 0.02: down to 2 at once, though a group was dropped.
    over = KlReport(kl=0.02, lag=2.5, staleness=3)
    assert auto.observe(5, data_wait_s=0.5, step_s=1.0, model_staleness=4, kl=over) == 2
    # Just at the ceiling is not past it; a waited batch may then raise, but never back to
    # 3: S = 3 is the ceiling now (no KL report this batch, so no extrapolated room either).
    at = KlReport(kl=0.01, lag=1.5, staleness=2)
    assert auto.observe(**WAITED, model_staleness=4, kl=at) == 2
    assert auto.observe(6, data_wait_s=0.0, step_s=1.0, model_staleness=4) == 2
    # Past it again under S = 2: the ceiling comes down to 2, so S = 1 is the most a raise gets.
    assert auto.observe(**QUIET, model_staleness=4, kl=KlReport(0.03, 1.5, 2)) == 1
    assert auto.observe(**WAITED, model_staleness=4) == 1
    # A report on an older, higher-S batch pushes S no lower and lifts no ceiling.
    assert auto.observe(**WAITED, model_staleness=4, kl=over) == 1
    assert auto.observe(**WAITED, model_staleness=4) == 1


def test_without_a_ceiling_or_a_report_the_kl_moves_nothing():
    for kl_max, kl in ((0.0, KlReport(1.0, 2.0, 2)), (0.01, None)):
        auto = AutoStaleness(s_min=0, s_max=4, s=2, kl_max=kl_max)
        assert auto.observe(**WAITED, model_staleness=4, kl=kl) == 4


def test_a_raise_stops_at_the_room_the_kl_extrapolates_with_the_square_of_the_lag():
    # KL 0.0025 at mean lag 1: the square law predicts 0.01 at lag 2 and 0.0225 at 3.
    auto = AutoStaleness(s_min=0, s_max=4, s=1, kl_max=0.01)
    kl = KlReport(kl=0.0025, lag=1.0, staleness=1)
    assert auto.observe(**WAITED, model_staleness=4, kl=kl) == 2
    assert auto.observe(1, data_wait_s=0.0, step_s=1.0, model_staleness=None, kl=kl) == 2
    # A hair more KL and S = 2 is past the room: the raise is refused, S stays (not lowered).
    kl = KlReport(kl=0.0026, lag=1.0, staleness=2)
    assert auto.observe(**WAITED, model_staleness=4, kl=kl) == 2
    # Before the model is confident, the provisional raise obeys the room too.
    auto = AutoStaleness(s_min=0, s_max=4, s=1, kl_max=0.01)
    assert auto.observe(**WAITED, model_staleness=None, estimate=4, kl=kl) == 1


def test_a_batch_of_fresh_rows_says_nothing_of_staleness_and_leaves_the_room_open():
    auto = AutoStaleness(s_min=0, s_max=4, s=0, kl_max=0.01)
    # Mean lag 0.4 (mostly on-policy rows): its KL is the engine's numerics, however large.
    fresh = KlReport(kl=0.009, lag=0.4, staleness=0)
    assert auto.observe(**WAITED, model_staleness=3, kl=fresh) == 3


def test_the_kl_ceiling_lifts_after_quiet_batches_of_room_and_never_below_s_min():
    auto = AutoStaleness(s_min=1, s_max=4, s=3, kl_max=0.01, quiet_batches=2)
    assert auto.observe(**QUIET, model_staleness=3, kl=KlReport(0.05, 2.5, 3)) == 2
    # The policy settles: lag 2 at KL 0.001 predicts room for floor(2 * sqrt(10)) = 6.
    roomy = KlReport(kl=0.001, lag=2.0, staleness=2)
    # The rule judges the mean of the last 2 (quiet_batches) reports at an S: with this one
    # it is 0.008 (under the ceiling), room for floor(2 * sqrt(1.25)) = 2.
    tight = KlReport(kl=0.015, lag=2.0, staleness=2)
    steps = [auto.observe(**WAITED, model_staleness=4, kl=kl) for kl in (roomy, tight, roomy)]
    assert steps == [2, 2, 2]  # one roomy batch, then none: held below the ceiling
    assert auto.observe(**WAITED, model_staleness=4, kl=roomy) == 2  # one in a row
    assert auto.observe(**WAITED, model_staleness=4, kl=roomy) == 3  # two: the ceiling is 4
    assert auto.observe(**WAITED, model_staleness=4, kl=roomy) == 3
    assert auto.observe(**WAITED, model_staleness=4, kl=roomy) == 4  # lifted past S_max
    # Past the ceiling at S_min itself: S cannot go lower, and no raise leaves it.
    auto = AutoStaleness(s_min=1, s_max=4, s=1, kl_max=0.01)
    assert auto.observe(**WAITED, model_staleness=4, kl=KlReport(0.05, 1.0, 1)) == 1
    # Batches without a report, or of fresh rows, are no evidence of room: the ceiling stays.
    fresh = KlReport(0.0, 0.2, 1)
    assert [auto.observe(**WAITED, model_staleness=4, kl=k) for k in (None, fresh) * 4] == [1] * 8


def test_a_controller_steps_s_down_on_the_learners_kl_report_for_the_batch_it_took(
    tmp_path, caplog
):
    ctl = make(
        tmp_path, staleness=2, staleness_auto=True, staleness_min=0, staleness_max=3,
        staleness_kl_max=0.01, groups_per_step=1, max_groups_per_lease=1,
    )  # fmt: skip
    ctl.publish(0)
    w = worker(ctl)

    def one_batch(step: int, version: int) -> dict:
        lease = ctl.lease(w, LeaseRequest(worker_version=version, max_groups=1)).lease
        for v in range(version + 1, step + 1):
            ctl.publish(v)
        submit_all(ctl, w, lease, versions=(version,) * 3)
        batch, stats = ctl.wait_batch(step, 1, timeout_s=5.0)
        assert batch is not None
        return stats

    assert one_batch(2, 0)["staleness/bound"] == 2  # lag 2, taken under S = 2
    ctl.report_learner(step_s=1.0, staleness_kl=0.02)
    assert ctl.auto_staleness.kl_ceiling is None  # evidence is read at the next batch
    with caplog.at_level("WARNING"):
        assert one_batch(3, 2)["staleness/bound"] == 1
    assert ctl.auto_staleness.kl_ceiling == 2 and ctl.config.staleness == 1
    # The console says why S fell and how far it may rise.
    assert "staleness/kl 0.02 at S = 2 is past staleness_kl_max 0.01: S -> 1" in caplog.text
    # The report is evidence once: a batch with no new report leaves S where it is, though
    # the earlier report would have said past the ceiling again.
    ctl.report_learner(step_s=1.0)
    auto, ctl.auto_staleness.kl_ceiling = ctl.auto_staleness, None
    assert one_batch(4, 3)["staleness/bound"] == 1 and auto.kl_ceiling is None


def test_one_noisy_batch_does_not_trip_the_ceiling_but_a_first_report_at_a_new_s_can():
    # The demo's per-batch KL at S = 2 had median 0.014 and maximum 0.12.
    auto = AutoStaleness(s_min=0, s_max=4, s=2, kl_max=0.05)
    calm, spike = KlReport(0.01, 1.8, 2), KlReport(0.12, 1.8, 2)
    steps = [auto.observe(**QUIET, model_staleness=2, kl=k) for k in (calm, calm, calm, spike)]
    assert steps == [2] * 4
    auto = AutoStaleness(s_min=0, s_max=4, s=2, kl_max=0.05)
    assert auto.observe(**QUIET, model_staleness=2, kl=spike) == 1


def test_a_stay_at_an_s_after_its_ceiling_lifted_is_judged_afresh():
    auto = AutoStaleness(s_min=0, s_max=4, s=2, kl_max=0.05, quiet_batches=2)
    assert auto.observe(**QUIET, model_staleness=2, kl=KlReport(0.2, 1.8, 2)) == 1
    settled = KlReport(0.001, 1.0, 1)  # room for floor(sqrt(50)) = 7: the ceiling lifts
    assert [auto.observe(**WAITED, model_staleness=2, kl=settled) for _ in range(2)] == [1, 2]
    # Back at 2, a calm report is not averaged with the one that set the ceiling.
    assert auto.observe(**QUIET, model_staleness=2, kl=KlReport(0.02, 1.8, 2)) == 2
    # Past it again: the second lift waits twice as many roomy batches (4), the third 8.
    for trip, wait in ((2, 4), (3, 8)):
        assert auto.observe(**QUIET, model_staleness=2, kl=KlReport(0.3, 1.8, 2)) == 1
        lifts = [auto.observe(**WAITED, model_staleness=2, kl=settled) for _ in range(wait)]
        assert lifts == [1] * (wait - 1) + [2] and auto.kl_trips == trip


def test_the_rooms_edges_half_a_version_of_lag_is_evidence_and_room_at_the_ceiling_lifts_it():
    # Mean lag exactly 0.5 is evidence: KL 0.01 there leaves room for floor(0.5) = 0.
    auto = AutoStaleness(s_min=0, s_max=4, s=0, kl_max=0.01)
    assert auto.observe(**WAITED, model_staleness=3, kl=KlReport(0.01, 0.5, 0)) == 0
    # Room exactly at the ceiling counts: floor(2 * sqrt(0.01 / 0.004)) = 3 = the ceiling.
    auto = AutoStaleness(s_min=0, s_max=4, s=3, kl_max=0.01, quiet_batches=1)
    assert auto.observe(**QUIET, model_staleness=3, kl=KlReport(0.05, 2.5, 3)) == 2
    assert auto.observe(**WAITED, model_staleness=3, kl=KlReport(0.004, 2.0, 2)) == 3


def test_a_trip_starts_the_quiet_stretch_afresh():
    auto = AutoStaleness(s_min=0, s_max=4, s=3, kl_max=0.01, quiet_batches=2)
    assert auto.observe(**QUIET, model_staleness=0) == 3  # one quiet batch so far
    assert auto.observe(**QUIET, model_staleness=0, kl=KlReport(0.05, 2.5, 3)) == 2
    # The model asks for less: down again only after 2 more quiet batches, not 1.
    assert [auto.observe(**QUIET, model_staleness=0) for _ in range(2)] == [2, 1]
