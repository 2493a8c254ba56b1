"""The planner against a real run: bridge/plan/from_run.py on a short run of the demo config.

One real run (bench/plan_vs_run.py: `python -m learner_jax.train`, tiny 2 x 64 model, no
SFT, two vLLM workers of different prices, one throttled), then `fleet_from_run` must turn
its files into a valid FLEET.json whose inputs are the run's own numbers, the planner must
be fed exactly those, and the live capacity model's confident predictions must reach the
metrics, the console and the summary. How close the predictions come to the measured
utilization and cost depends on the machine's load, so that comparison is the bench's
(`python -m bench.plan_vs_run --out=F.json`), not an assertion here.
The whole test 40-200 s, most of it the workers' start-up.
"""

import json
import math
import os
import re
import statistics

import pytest

from bench import plan_vs_run
from bridge.plan import fleet as fleet_lib
from bridge.plan import from_run, planner

STEPS = 30  # enough lines for the live model's warm-up (capacity.Warmup) and a steady state


@pytest.mark.slow
@pytest.mark.vllm
def test_plan_of_a_real_run_is_fed_the_runs_own_numbers(tmp_path):
    workdir = str(tmp_path / "run")
    run = plan_vs_run.run_demo(workdir, STEPS)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    raw = from_run.fleet_from_run(workdir)
    fleet = fleet_lib.parse(json.loads(json.dumps(raw)))  # valid FLEET.json as written
    rows = from_run._rl_rows(workdir)
    assert len(rows) == STEPS and fleet.steps == STEPS - 1  # the first line waits for start-up
    step_s, overhead_s = from_run.learner_times(rows[1:])
    assert step_s == pytest.approx(statistics.fmean(r["time/step_s"] for r in rows[1:]))
    assert fleet.learner.step_s == pytest.approx(step_s + overhead_s) and overhead_s >= 0
    assert fleet.learner.rollouts_per_step == 16 * 16
    assert (fleet.staleness, fleet.publish_every) == (2, 1)
    assert sorted(w.price_per_hour for w in fleet.workers) == [0.15, 0.40]
    assert all(w.rollouts_per_s > 0 and w.lease_s > 0 for w in fleet.workers)
    assert fleet.margin > 1e6  # activation off: planned with every worker active

    # The comparison plans exactly this fleet and measures this run's lines.
    r = plan_vs_run.report(workdir, run.stderr)
    plan, measured = r["plan"]["plan"], r["plan"]["measured"]
    print(json.dumps({k: r["plan"][k] for k in ("plan", "measured", "error")}, indent=1))
    planned = planner.plan(fleet)
    assert plan["active_workers"] == 2 == sum(planned["active"].values())
    assert plan["cost_per_step_usd"] == pytest.approx(planned["cost_per_step_usd"])
    assert plan["utilization"] == pytest.approx(
        planned["predicted_utilization"] * measured["step_s_mean"] / fleet.learner.step_s
    )
    assert measured == from_run.measured(workdir) and measured["steps"] == STEPS - 1
    assert 0 < measured["utilization"] <= 1 and 0 < plan["utilization"] <= 1
    assert r["plan"]["error"]["utilization"] == pytest.approx(
        plan["utilization"] / measured["utilization"] - 1
    )
    live_capacity_predictions_reach_the_metrics_console_and_summary(rows, r["live"], workdir)


def live_capacity_predictions_reach_the_metrics_console_and_summary(rows, live, workdir):
    """The controller's confident predictions (warm measurements only,
    bridge/control/fleet/fleet_plan.py) are on the steady lines; the bench's weighting of
    them and of the measurement is what the run's summary states; every capacity warning on
    the console names a utilization."""
    confident = [r for r in from_run.warm_rows(rows) if r["learner/utilization"]]
    assert confident, "no confident capacity prediction in a 30-step run"
    assert live["confident_lines"] == len(confident)
    for r in confident:
        assert 0 < r["capacity/predicted_utilization"] <= 1, r
    assert 0 < live["predicted"] <= 1 and 0 < live["measured"] <= 1
    assert math.isclose(live["points"], live["predicted"] - live["measured"])
    print(f"capacity: predicted {live['predicted']:.3f}, measured {live['measured']:.3f}")
    print("\n".join(live["console"]))
    assert len(live["warned"]) == sum("will wait" in line for line in live["console"])
    summary = open(os.path.join(workdir, "summary.md")).read()
    said = re.search(r"utilization: ([0-9.]+) predicted vs ([0-9.]+) measured", summary)
    assert said and said.groups() == (f"{live['predicted']:.3f}", f"{live['measured']:.3f}")


def test_learner_times_leave_a_compile_out_of_the_overhead():
    # Lines 0.3 s apart with 0.2 s train steps and 0.05 s waits: 0.05 s of the learner's own
    # time per step. Line 3's window held a 1 s compile (the first audit re-score): the
    # gaps next to it are left out, the train steps are not.
    def line(step, wall, compiled=0):
        return {"time/wall": wall, "time/step_s": 0.2, "time/data_wait_s": 0.05,
                "time/wait_s": 0.06, "time/compiled": compiled}  # fmt: skip

    walls = [0.0, 0.3, 0.6, 0.9, 2.2, 2.5, 2.8]  # the compile ran after line 3's publish
    rows = [line(i, w, compiled=int(i == 3)) for i, w in enumerate(walls)]
    step_s, overhead_s = from_run.learner_times(rows)
    assert step_s == pytest.approx(0.2)
    assert overhead_s == pytest.approx(0.05)
    # Without the flag the compile is spread over the six gaps: (5 x 0.05 + 1.05) / 6.
    for r in rows:
        r["time/compiled"] = 0
    assert from_run.learner_times(rows)[1] == pytest.approx((5 * 0.05 + 1.05) / 6)


def test_measured_utilization_is_train_time_over_wall_time():
    # Three lines that trained 0.2 s of 0.25 s and one that waited 0.8 s: 0.8 s of 1.75 s.
    # A plain mean of the ratios (0.650) would overstate it.
    rows = [{"time/step_s": 0.2, "learner/utilization": u} for u in (0.8, 0.8, 0.2, 0.8)]
    assert from_run.train_share(rows) == pytest.approx(0.8 / 1.75)


def test_measured_utilization_leaves_out_the_warm_up_and_compiles():
    # Two cold lines (no confident prediction yet) that mostly waited, a compiled line, then
    # the steady state: 0.2 s of train time in each 0.25 s.
    def line(u, confident=1, compiled=0):
        return {"time/step_s": 0.2, "learner/utilization": u, "capacity/confident": confident,
                "time/compiled": compiled}  # fmt: skip

    rows = [line(0.1, 0), line(0.2, 0), line(0.05, compiled=1), *[line(0.8)] * 4]
    assert from_run.warm_rows(rows) == [line(0.8)] * 4
    assert from_run.train_share(from_run.warm_rows(rows)) == pytest.approx(0.8)
    assert from_run.warm_rows(rows[:4]) == []  # one steady line is no steady state
