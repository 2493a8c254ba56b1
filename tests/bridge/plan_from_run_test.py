"""The planner against a real run: bridge/plan/from_run.py on a short run of the demo config.

One real run (`python -m learner_jax.train`, tiny 2 x 64 model, no SFT, two vLLM workers of
different prices, one throttled), then `fleet_from_run` must turn its files into a valid
FLEET.json whose inputs are the run's own numbers, and the planner fed them must predict the
run's learner utilization and fleet cost per step. The target is 10%; the assertion allows
25%, because on the shared 2-core CI box the run's numbers swing with the load of whatever
else is running (the measured step time already carries the workers' share of the cores,
but that share changes while the run goes on); bench/activation.py reports the errors.
One run (load average ~15): utilization 0.471 predicted vs 0.456 measured (+3%), cost per
step -8%. On a quiet box the old "controller" admission underpredicted by 21-30% (it idles
a worker for its whole publish -> serving delay); planned "held" (from_run.py): 0.626 vs
0.645 (-3%), cost +0.3%. Stop 39 (measured utilization = train time over wall time,
compiles left out of the plan's overhead): +2 to +7% here; before, -10 to -22%. Stop 40
(the learner and the workers on separate cores, `separate_cpus`; measured on the steady
lines, `from_run.warm_rows`): -8 to +1% in five runs, one with a busy loop on the learner's
core; over every line after the first, +10 to +24%, the warm-up the plan does not model.
The whole test 40-144 s, most of it the workers' start-up.
"""

import json
import os
import re
import statistics
import subprocess
import sys

import pytest

from bridge.plan import fleet as fleet_lib
from bridge.plan import from_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 30
ARGS = [
    f"--config.total_steps={STEPS}",
    "--config.model.tiny_num_layers=2",
    "--config.model.tiny_hidden_size=64",
    "--config.model.tiny_intermediate_size=128",
    "--config.sft.steps=0",
    "--config.task.eval_size=20",
    "--config.rollout.eval_period=0",
    "--config.checkpoint.interval=100",
    "--config.local_workers=2",
    "--config.fleet.prices=(0.40,0.15)",
    "--config.fleet.throttle_s=(0.0,0.3)",
    # from_run plans a store broadcast (every worker reads the store, its measured swap
    # delay a bandwidth), what "auto" picks for this local store; a chain puts two relays
    # and their fetches on the same two cores, which the planner does not model (BUILD_NOTES,
    # planner vs a run), so the test pins it.
    "--config.bridge.broadcast=store",
]


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.alone  # predicted vs measured utilization: a neighbour's load moves the measure
def test_plan_of_a_real_run_predicts_its_utilization_and_cost(tmp_path):
    workdir = str(tmp_path / "run")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    cmd = [sys.executable, "-m", "learner_jax.train", "--config=configs/tiny_arith.py"]
    learner_cpus, pin_workers = separate_cpus()
    run = subprocess.run(
        [*cmd, f"--workdir={workdir}", *ARGS, *pin_workers],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=lambda: os.sched_setaffinity(0, learner_cpus),
    )
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

    cmp = from_run.compare(workdir)
    print(json.dumps({k: cmp[k] for k in ("plan", "measured", "error")}, indent=1))
    assert cmp["same_active_count"]
    assert cmp["measured"]["utilization_lines"] >= 10  # the steady state is most of the run
    assert abs(cmp["error"]["utilization"]) < 0.25
    assert abs(cmp["error"]["cost_per_step"]) < 0.25
    live_capacity_advice_agrees_with_the_run(rows, run.stderr, workdir)


def separate_cpus():
    """The learner on the first CPU this test may use, the workers on the others: the
    planner and the live model assume the product's separate machines. Sharing two cores,
    the learner's step time followed the workers' load (0.16 s when the live model first
    spoke, 0.205 s mean later in stop 39's CI run), which no prediction from the first
    steps can foresee. Pinned, its step time holds (0.12-0.155 s over a run here)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return set(cpus), []
    workers = ",".join(str(c) for c in cpus[1:])
    return {cpus[0]}, [f"--config.fleet.worker_cpus=({workers},)"]


LIVE_POINTS = 0.10


def live_capacity_advice_agrees_with_the_run(rows, console, workdir):
    """Issue 32 on the same run: the controller's confident predictions (warm measurements
    only, bridge/control/fleet/fleet_plan.py) are within LIVE_POINTS of the utilization measured on
    the same steps, and no capacity warning on the console names a utilization that the
    run's own measurement beats by more than LIVE_POINTS. Measured utilization is train time
    over wall time on those steps (each line's wall time = its train time / its
    utilization), the predictions weighted the same way; one early prediction cannot foresee
    the shared box's load moving T and the workers' speed later in the run.

    Quiet 2-core box, before the fixes of stop 33: +8.9 to +12.7 points (the workers' rate
    was rollouts per lease-held second, while a fast worker spends ~10% of its time between
    leases), judged against a plain mean of per-step ratios, which overstated the measured
    utilization by up to 14 points (0.597 for a run that trained 0.456 of its wall time).
    After: -3.1 and +2.3 points (BUILD_NOTES, issue 32).

    Steps whose window held an XLA compile are left out here, as the prediction leaves them
    out (learner_jax/compiles.py): stop 38's CI run counted the first audit re-score's
    compile as learner overhead, warned at 36% and then measured 53%."""
    confident = [r for r in from_run.warm_rows(rows) if r["learner/utilization"]]
    assert confident, "no confident capacity prediction in a 30-step run"
    walls = [r["time/step_s"] / r["learner/utilization"] for r in confident]
    measured = sum(r["time/step_s"] for r in confident) / sum(walls)
    predicted = sum(
        r["capacity/predicted_utilization"] * w for r, w in zip(confident, walls, strict=True)
    ) / sum(walls)
    said = [line for line in console.splitlines() if "capacity:" in line]
    print(f"capacity: predicted {predicted:.3f}, measured {measured:.3f} on {len(confident)}")
    print("\n".join(said))
    assert abs(predicted - measured) <= LIVE_POINTS, (predicted, measured)
    warned = [int(p) for p in re.findall(r"will wait \(predicted utilization (\d+)%", console)]
    assert all(p / 100 >= measured - LIVE_POINTS for p in warned), (warned, measured)
    summary = open(os.path.join(workdir, "summary.md")).read()
    assert f"- predicted vs measured utilization: {predicted:.3f} predicted vs" in summary


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
