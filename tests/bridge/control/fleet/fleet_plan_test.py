"""The live capacity model (bridge/control/fleet/fleet_plan.py): measured rates, T and O, the
verdict and its advice, driven through a real Controller on a temp SQLite file with an
injected clock. Cost-aware activation on the same measurements: live_activation_test.py."""

import logging
import math

import pytest

from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.fleet import capacity
from bridge.control.fleet.capacity import busy_rate
from bridge.control.protocol import (
    GroupResult,
    Heartbeat,
    LeaseRequest,
    SamplingParams,
    Submission,
    WorkerProfile,
    WorkerTrajectory,
)
from bridge.tasks import make_task

R = 4  # rollouts per step: groups_per_step 2 * group_size 2


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def make(tmp_path, text_codec, clock, **cfg):
    base = dict(
        staleness=20,  # room to lease every group these tests measure with
        groups_per_step=2,
        group_size=2,
        lease_ttl_s=30.0,
        sampling=SamplingParams(max_tokens=4),
        vocab_size=100,
    )
    return Controller(
        ControllerConfig(**{**base, **cfg}),
        str(tmp_path / "ctl.db"),
        make_task("arithmetic"),
        clock,
        codec=text_codec,
    )


def worker(ctl, price):
    profile = WorkerProfile(accelerator="cpu", price_per_hour=price, max_concurrent_sequences=64)
    return ctl.register(profile)[0]


def run_lease(ctl, clock, wid, groups, seconds, version=0):
    """`wid` leases `groups` groups and submits them `seconds` later: 2 * groups rollouts."""
    lease = ctl.lease(wid, LeaseRequest(worker_version=version, max_groups=groups)).lease
    assert len(lease.groups) == groups
    clock.t += seconds
    results = [
        GroupResult.model_construct(
            group_id=g.group_id,
            trajectories=[
                WorkerTrajectory.model_construct(
                    prompt_id=g.prompt_id,
                    sample_index=i,
                    prompt_token_ids=list(g.prompt_token_ids),
                    completion_token_ids=[10 + i] * 3,
                    logprobs=[-0.5] * 3,
                    versions=[version] * 3,
                    finish_reason="stop",
                )
                for i in range(2)
            ],
        )
        for g in lease.groups
    ]
    assert ctl.submit(wid, Submission(lease_id=lease.lease_id, groups=results)).accepted


def hb(ctl, wid, version=0):
    return ctl.heartbeat(wid, Heartbeat(worker_version=version))


def test_busy_rate_counts_overlapping_leases_once_and_idle_time_not_at_all():
    # Two concurrent leases over [0, 4] and one after an idle gap over [10, 12].
    rate, mean = busy_rate([(0.0, 4.0, 8), (1.0, 3.0, 4), (10.0, 12.0, 6)])
    assert rate == pytest.approx(18 / 6) and mean == pytest.approx(8 / 3)


def test_own_rate_counts_the_gaps_between_leases_unless_the_controller_held_the_worker():
    # Three 1 s leases of 10 rollouts with 0.25 s between them (round trips, a swap): the
    # worker's own time is 3 s + 2 gaps, scaled to one gap per lease (3 x 1.25 s).
    leases = [(0.0, 1.0, 10), (1.25, 2.25, 10), (2.5, 3.5, 10)]
    assert capacity.own_rate(leases) == pytest.approx(30 / 3.75)
    assert busy_rate(leases)[0] == pytest.approx(30 / 3.0)  # the busy rate overstates it
    # Refused at 1.05 (admission full) and at 2.3: only 0.05 s of each gap is the worker's.
    assert capacity.own_rate(leases, [1.05, 2.3]) == pytest.approx(30 / (3 + 0.1 * 3 / 2))
    # An outage (a 100 s gap) counts as one mean lease at most.
    far = [(0.0, 1.0, 10), (101.0, 102.0, 10)]
    assert capacity.own_rate(far) == pytest.approx(20 / (2 + 1.0 * 2))


def test_time_the_controller_held_a_worker_back_is_not_counted_as_its_slowness(
    tmp_path, text_codec
):
    # S = 2, 2 groups a step: 6 groups may be leased + buffered. Three 0.5 s leases of 2
    # groups (4 rollouts) back to back (the first is cold), then the worker asks again, is
    # refused ("full": admission) and gets work 5 s later, after the learner took a batch
    # and published the version it works on next.
    clock = Clock()
    ctl = make(tmp_path, text_codec, clock, staleness=2)
    ctl.publish(0)
    w = worker(ctl, 1.0)
    hb(ctl, w, 0)
    for _ in range(3):
        run_lease(ctl, clock, w, groups=2, seconds=0.5)
    refused = ctl.lease(w, LeaseRequest(worker_version=0, max_groups=2))
    assert refused.lease is None and refused.reason == "full"
    clock.t += 5.0
    ctl.take_batch(0, 2)
    ctl.report_learner(step_s=1.0)
    ctl.publish(1)
    hb(ctl, w, 1)
    run_lease(ctl, clock, w, groups=2, seconds=0.5, version=1)
    # Warm leases 2-4: 12 rollouts in 1.5 s of the worker's own time (the 5 s wait was the
    # controller's). Counted as its own, the wait would read 12 / 2.25 s (capped at a lease).
    stats = ctl.stats()
    assert stats["capacity/active_rollouts_per_s"] == pytest.approx(12 / 1.5)


def test_capacity_metrics_follow_the_model_on_measured_inputs(tmp_path, text_codec, caplog):
    clock = Clock()
    ctl = make(tmp_path, text_codec, clock, staleness=2)
    ctl.publish(0)
    w = worker(ctl, 1.0)
    clock.t += 3
    hb(ctl, w)  # first reports version 0: 3 s after it was published
    run_lease(ctl, clock, w, groups=2, seconds=4.0)  # 4 rollouts in 4 s: 1/s, T_gen 4 s
    ctl.report_learner(step_s=2.0, publish_s=0.5)
    ctl.report_learner(step_s=2.0, publish_s=0.0)  # a step that did not publish
    ctl.publish(2)  # versions 0 -> 2: kappa = 2
    with caplog.at_level(logging.WARNING):
        batch, stats = ctl.take_batch(0, 2)
    assert batch is not None
    want = capacity.report(1.0, R, 2.0, 2, 2, 0.5 + 3.0 + 4.0)
    assert stats["capacity/required_rollouts_per_s"] == pytest.approx(want.required_rollouts_per_s)
    assert stats["capacity/active_rollouts_per_s"] == pytest.approx(1.0)
    assert stats["capacity/predicted_utilization"] == pytest.approx(want.predicted_utilization)
    assert stats["capacity/min_staleness"] == want.min_staleness == 2 + math.ceil(7.5 / 2)
    assert stats["capacity/latency_s"] == pytest.approx(7.5)
    # One lease, one swap, one warm learner report: every input is cold or too thin for a
    # verdict (capacity.Warmup), so the numbers are shown but no advice is given.
    assert stats["capacity/confident"] == 0 and stats["capacity/warning"] == 0
    assert not [r for r in caplog.records if "capacity" in r.getMessage()]
    # The same verdict given on warm inputs names both fixes.
    with caplog.at_level(logging.WARNING):
        ctl.fleet.advice.say(want, clock())
    warned = [r.getMessage() for r in caplog.records if "capacity" in r.getMessage()]
    assert len(warned) == 1 and "raise `staleness` to 6" in warned[0] and "add workers" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # the same verdict, a minute later: not repeated
        clock.t += 61
        hb(ctl, w, 0)
        ctl.stats()
        assert not [r for r in caplog.records if "capacity" in r.getMessage()]
    assert ctl.stats()["cost/usd_per_1k_rollouts"] == pytest.approx(
        1000 * ctl.stats()["cost/usd"] / 4
    )


def test_without_a_learner_report_the_step_period_stands_in(tmp_path, text_codec):
    clock = Clock()
    ctl = make(tmp_path, text_codec, clock)
    ctl.publish(0)
    w = worker(ctl, 1.0)
    run_lease(ctl, clock, w, groups=4, seconds=1.0)
    _, first = ctl.take_batch(0, 2)
    assert "capacity/required_rollouts_per_s" not in first  # T unknown yet
    clock.t += 5
    _, stats = ctl.take_batch(1, 2)
    assert stats["capacity/required_rollouts_per_s"] == pytest.approx(R / 5)
    assert stats["capacity/warning"] == 0  # 8 rollouts/s measured, 0.8 needed


def warm_steps(ctl, clock, w, versions, lease_s=0.5, step_s=1.0, report=None):
    """Per version: publish it, the worker reports it 0.1 s later and leases 2 groups (4
    rollouts) for `lease_s`, the learner reports a `step_s` update (or `report(v)`'s
    keywords for `report_learner`). Returns the last stats."""
    for v in versions:
        ctl.publish(v)
        clock.t += 0.1
        hb(ctl, w, v)  # swap: 0.1 s after the publish
        run_lease(ctl, clock, w, groups=2, seconds=lease_s, version=v)
        ctl.report_learner(**(report(v) if report else {"step_s": step_s}))
        stats = ctl.stats()
    return stats


def cold_start(tmp_path, text_codec, clock):
    """S = 2 and one worker whose start-up is cold: its engine start (the first swap, 30 s),
    its first lease (20 s: vLLM's kernel compile) and the learner's first update (5 s: XLA)."""
    ctl = make(tmp_path, text_codec, clock, staleness=2)
    ctl.publish(0)
    w = worker(ctl, 1.0)
    clock.t += 30.0
    hb(ctl, w, 0)
    run_lease(ctl, clock, w, groups=2, seconds=20.0)
    ctl.report_learner(step_s=5.0)
    return ctl, w


def test_advice_comes_from_warm_measurements_only(tmp_path, text_codec, caplog):
    # Cold inputs alone predict a starved learner (latency 50 s, 0.2 rollouts/s against 4).
    # Warm, the worker swaps in 0.1 s and makes 4 rollouts in 0.5 s: 6.7/s against 4 needed,
    # latency 0.6 s < T: no advice may ever be given (the bug: the demo's first warning).
    clock = Clock()
    with caplog.at_level(logging.INFO):
        ctl, w = cold_start(tmp_path, text_codec, clock)
        cold = ctl.stats()
        assert cold["capacity/latency_s"] == pytest.approx(50.0)  # shown, cold as it is
        assert cold["capacity/confident"] == 0 and cold["capacity/warning"] == 0
        # Confident once T has 5 warm reports (versions 1-5) and the worker 5 warm leases
        # (1-5) and 5 warm swaps (its first two, versions 0 and 1, are cold: 2-6).
        assert warm_steps(ctl, clock, w, range(1, 6))["capacity/confident"] == 0
        warm = warm_steps(ctl, clock, w, [6])
        assert warm["capacity/confident"] == 1 and warm["capacity/warning"] == 0
        assert warm["capacity/train_step_s"] == pytest.approx(1.0)
        assert warm["capacity/latency_s"] == pytest.approx(0.1 + 0.5)
        # 4 rollouts per 0.5 s lease and the 0.1 s swap before each: the worker's own time.
        assert warm["capacity/active_rollouts_per_s"] == pytest.approx(4 / 0.6)
        assert warm["capacity/predicted_utilization"] == pytest.approx(1.0)
        clock.t += 120.0
        warm_steps(ctl, clock, w, range(7, 10))
    assert not [r for r in caplog.records if "capacity" in r.getMessage()]


def test_a_warning_the_warm_data_contradicts_is_withdrawn(tmp_path, text_codec, caplog):
    clock = Clock()
    ctl, w = cold_start(tmp_path, text_codec, clock)
    with caplog.at_level(logging.INFO):
        # Warm and slow: 3 s leases (1.33 rollouts/s, 4 needed; latency 3.1 s > T).
        slow = warm_steps(ctl, clock, w, range(1, 7), lease_s=3.0)
        assert slow["capacity/confident"] == 1 and slow["capacity/warning"] == 1
        # Then fast for longer than the 16 leases kept, and past the minute between lines.
        warm_steps(ctl, clock, w, range(7, 24), lease_s=0.5)
        clock.t += 60.0
        fast = warm_steps(ctl, clock, w, [24], lease_s=0.5)
    assert fast["capacity/confident"] == 1 and fast["capacity/warning"] == 0
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if "capacity" in r.getMessage()]
    assert len(lines) == 2, lines
    (level0, said), (level1, taken_back) = lines
    assert level0 == logging.WARNING and "add workers" in said and "raise `staleness`" in said
    assert level1 == logging.INFO and taken_back.startswith("capacity: withdrawn")
    assert "predicted utilization 100%" in taken_back


def test_freshness_is_judged_by_the_workers_that_cover_the_requirement():
    from bridge.control.fleet.fleet_plan import _covering_delay

    fast, slow = (0.2, 30.0), (3.0, 10.0)  # (swap + generation delay s, rollouts/s)
    assert _covering_delay([slow, fast], required=25.0) == 0.2  # the fast one alone covers
    assert _covering_delay([slow, fast], required=35.0) == 3.0  # both needed: the slow counts
    assert _covering_delay([slow, fast], required=99.0) == 3.0  # short fleet: the slowest
    assert _covering_delay([], required=1.0) == 0.0


def test_a_capacity_warning_repeats_only_when_worse_or_after_ten_minutes(
    tmp_path, text_codec, caplog
):
    ctl = make(tmp_path, text_codec, Clock(), staleness=2)

    def verdict(min_staleness, rate_ok=True):
        return capacity.CapacityReport(10.0, 10.0 if rate_ok else 5.0, 0.5, min_staleness,
                                       rate_ok, fresh_ok=False)  # fmt: skip

    def warned(t, report):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            ctl.fleet.advice.say(report, t)
        return [r.getMessage() for r in caplog.records if "capacity" in r.getMessage()]

    assert "raise `staleness` to 4" in warned(0, verdict(4))[0]
    assert not warned(30, verdict(6))  # worse, but within the minute
    assert not warned(70, verdict(4))  # the same verdict: not again yet
    assert "raise `staleness` to 6" in warned(80, verdict(6))[0]  # worse, a minute on
    assert not warned(200, verdict(5))  # better than what was said
    assert "add workers" in warned(300, verdict(5, rate_ok=False))[0]  # a new cause
    assert not warned(500, verdict(5, rate_ok=False))
    assert len(warned(901, verdict(5, rate_ok=False))) == 1  # 10 minutes on: once more


def test_the_learners_own_overhead_lowers_the_prediction_and_the_requirement(tmp_path, text_codec):
    # Warm as in the test above (T = 1 s, 8 rollouts/s, fed at every step: 1.0), then the
    # learner reports 1 s of its own time per update (evaluation, checkpoints): it trains
    # T / (T + O) = half of the wall time, and needs R / (T + O) rollouts/s, not R / T.
    clock = Clock()
    ctl, w = cold_start(tmp_path, text_codec, clock)
    warm_steps(ctl, clock, w, range(1, 5))
    stats = warm_steps(
        ctl, clock, w, range(5, 13), report=lambda v: {"step_s": 1.0, "overhead_s": float(v > 9)}
    )
    # The mean over the reports that carried one, but the first three (Warmup.cold_overheads)
    overhead = (0.0 + 0.0 + 1.0 + 1.0 + 1.0) / 5
    assert stats["capacity/learner_overhead_s"] == pytest.approx(overhead)
    assert stats["capacity/train_step_s"] == pytest.approx(1.0)
    assert stats["capacity/required_rollouts_per_s"] == pytest.approx(R / (1.0 + overhead))
    assert stats["capacity/predicted_utilization"] == pytest.approx(1.0 / (1.0 + overhead))


def test_the_first_overhead_reports_are_the_run_settling_and_later_spikes_count(
    tmp_path, text_codec
):
    # The learner's 3rd report carries a 2 s one-off (plan_from_run_test's runs: 0.16-0.2 s
    # in taking the 3rd batch): the first three are left out, so O stays 0 for the verdict.
    # A spike after them is a real cost per update (an evaluation): O is their mean.
    clock = Clock()
    ctl, w = cold_start(tmp_path, text_codec, clock)
    warm_steps(ctl, clock, w, range(1, 5))
    settling = {5: 0.0, 6: 0.0, 7: 2.0}
    stats = warm_steps(
        ctl,
        clock,
        w,
        range(5, 10),
        report=lambda v: {"step_s": 1.0, "overhead_s": settling.get(v, 0.0)},
    )
    assert stats["capacity/learner_overhead_s"] == 0.0
    assert stats["capacity/predicted_utilization"] == pytest.approx(1.0)
    stats = warm_steps(
        ctl,
        clock,
        w,
        range(10, 12),
        report=lambda v: {"step_s": 1.0, "overhead_s": 2.0 * (v == 11)},
    )
    assert stats["capacity/learner_overhead_s"] == pytest.approx(2.0 / 4)


def test_reports_with_a_compile_are_not_warm_samples(tmp_path, text_codec):
    # As above, but after four more warm updates (the first three overheads are the run
    # settling) the learner's next 8 came with XLA compiles (new shapes;
    # learner_jax/compiles.py): 4 s steps and 3 s of overhead, one-offs, so neither moves T
    # or O and the prediction stays the warm one. Taken as warm, T would be the median of
    # 8 x 1 s and 8 x 4 s (2.5 s) and O the mean of 0 and 8 x 3 s.
    clock = Clock()
    ctl, w = cold_start(tmp_path, text_codec, clock)
    warm_steps(ctl, clock, w, range(1, 5))
    warm, compiled = {"step_s": 1.0, "overhead_s": 0.0}, {"step_s": 4.0, "overhead_s": 3.0}
    compiled["cold"] = True
    stats = warm_steps(ctl, clock, w, range(5, 17), report=lambda v: warm if v <= 8 else compiled)
    assert stats["capacity/learner_overhead_s"] == 0.0
    assert stats["capacity/train_step_s"] == pytest.approx(1.0)
    assert stats["capacity/predicted_utilization"] == pytest.approx(1.0)


def test_stats_run_on_a_copy_that_the_live_fleet_does_not_change(tmp_path, text_codec):
    """`Controller.stats` computes on `FleetPlan.frozen` off the lock: leases, refusals,
    swaps and learner reports that land meanwhile change the live measurements, not the
    copy's numbers (nor break its iteration), and its rows are those committed when it
    was made."""
    clock = Clock()
    ctl = make(tmp_path, text_codec, clock, staleness=2)
    ctl.publish(0)
    w = worker(ctl, 1.0)
    clock.t += 1
    hb(ctl, w)
    run_lease(ctl, clock, w, groups=2, seconds=4.0)
    ctl.report_learner(step_s=2.0, publish_s=0.5)
    with ctl._op():
        ctl._persist_hot()
    with ctl.lock:
        frozen = ctl.fleet.frozen(ctl.db.pinned_view())
    before = frozen.stats(clock(), 4)
    assert before["capacity/active_rollouts_per_s"] == pytest.approx(1.0)
    clock.t += 1
    run_lease(ctl, clock, w, groups=1, seconds=0.1)  # a fast lease: the live rate jumps
    ctl.fleet.held_back(w, clock())
    ctl.fleet.swapped(w, 1, clock())
    ctl.report_learner(step_s=9.0, publish_s=3.0, overhead_s=1.0)
    ctl.timing.too_slow.add(w)
    assert frozen.stats(clock(), 4) == before
    ctl.db.unpin(frozen.db)
    assert ctl.stats()["capacity/train_step_s"] != before["capacity/train_step_s"]
