"""bench/staleness_sweep.py's bookkeeping on a written run directory (the runs themselves
are the bench: `python -m bench.staleness_sweep --quick`).

A workdir with known metrics.jsonl / eval.jsonl lines: the cell's time to target is the
first evaluation at or above the target (not the "before" one), counted from the start of
the first RL step; means, maxima and the per-(task, S, correction) summary over seeds."""

import argparse
import json

import pytest

from bench import staleness_sweep


def write_run(path, evals, staleness_max=3):
    path.mkdir()
    rows = [
        {"phase": "sft", "step": 0, "loss": 9.0},
        *[
            {
                "phase": "rl",
                "step": s,
                "time/wall": 100.0 + 2 * s,
                "time/step_s": 2.0,
                "learner/utilization": u,
                "staleness/mean": st,
                "staleness/max": m,
                "mismatch/kl": 1e-6 * s,
                # staleness/kl only from step 2 on (a metric a run's first rows may lack)
                **({"staleness/kl": 0.01 * s} if s > 1 else {}),
            }  # fmt: skip
            for s, u, st, m in ((1, 0.5, 1.0, 1), (2, 0.7, 2.0, staleness_max), (3, 0.9, 3.0, 2))
        ],
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (path / "eval.jsonl").write_text(
        "".join(
            json.dumps({"tag": t, "step": s, "time": tm, "accuracy": a}) + "\n"
            for t, s, tm, a in evals
        )
    )


def test_cell_and_summary(tmp_path):
    evals = [("before", 0, 90.0, 0.9), ("rl", 2, 105.0, 0.4), ("rl", 3, 107.5, 0.6)]
    write_run(tmp_path / "a", [*evals, ("after", 3, 108, 0.55)])
    a = staleness_sweep.cell_result(str(tmp_path / "a"), "accuracy", 0.5, process_s=30.0)
    assert a["steps"] == 3
    assert a["time_to_target_s"] == pytest.approx(107.5 - 100.0)  # 'before' does not count
    assert a["quality_before"] == 0.9 and a["quality_final"] == 0.55
    assert a["rl_wall_s"] == pytest.approx(106.0 - 100.0)
    assert a["learner_utilization"] == pytest.approx(0.7)
    assert a["staleness_mean"] == pytest.approx(2.0) and a["staleness_max"] == 3
    assert a["mismatch_kl"] == pytest.approx(2e-6)
    assert a["staleness_kl"] == pytest.approx(0.025)  # the rows that have it
    write_run(tmp_path / "b", [("before", 0, 90.0, 0.1), ("after", 3, 108, 0.35)], 5)
    b = staleness_sweep.cell_result(str(tmp_path / "b"), "accuracy", 0.5, process_s=30.0)
    assert b["time_to_target_s"] is None
    cells = [
        {"task": "demo", "S": 2, "correction": "tis", "seed": i, **c} for i, c in enumerate((a, b))
    ]
    (row,) = staleness_sweep.summarize(cells)
    assert row["quality_final"] == pytest.approx(0.45)
    assert row["quality_final_sd"] == pytest.approx(0.1414213, rel=1e-5)
    assert row["reached_target"] == "1/2" and row["time_to_target_s"] == pytest.approx(7.5)
    assert row["staleness_max"] == 5
    md = staleness_sweep.markdown([row]).splitlines()
    assert md[2].startswith("| demo | 2 | tis | +0.450 ± 0.141 | 1/2 | 8 | 0.70 | 2.00 / 5 |")
    # the JSON's rows: one per cell, in the form ../shared/DESIGN.md names for this bench
    assert staleness_sweep.rows_of(cells) == [
        {"task": "demo", "S": 2, "seed": 0, "correction": "tis", "quality": 0.55,
         "wall_s": pytest.approx(6.0)},
        {"task": "demo", "S": 2, "seed": 1, "correction": "tis", "quality": 0.35,
         "wall_s": pytest.approx(6.0)},
    ]  # fmt: skip


def test_cell_configs_take_the_overrides_and_refuse_unknown_keys():
    # bench/sweep_cells.py `load`: what `--config.KEY=VALUE` does, for the in-process cells
    from bench import sweep_cells

    a = argparse.Namespace(
        steps_kuhn=30, eval_period_kuhn=10, warmup_kuhn=10, steps_demo=20, eval_period_demo=5,
        warmup_demo=5, lr_demo=3e-4,
    )  # fmt: skip
    over = staleness_sweep.cell_overrides(a, "demo", 4, "token_mis", 2)
    pool = ["local_workers=0", "controller.port=12345", "controller.tell_run_over=False"]
    c = sweep_cells.load("configs/tiny_arith.py", [*pool, *over, "fleet.throttle_s=(0.0,1.0)"])
    assert (c.staleness, c.seed, c.total_steps, c.local_workers) == (4, 2, 20, 0)
    assert c.loss.off_policy == "token_mis" and c.controller.refuse_too_slow is False
    assert c.controller.port == 12345 and c.controller.tell_run_over is False
    assert c.optimizer.learning_rate == 3e-4 and c.optimizer.warmup_steps == 5
    assert c.optimizer.end_lr_fraction == 1.0 and c.fleet.throttle_s == (0.0, 1.0)
    kuhn = sweep_cells.load("configs/kuhn_poker.py", staleness_sweep.KUHN_RECIPE)
    assert kuhn.advantages.name == "dr_grpo" and kuhn.optimizer.learning_rate == 5e-4
    assert kuhn.loss.kl_coef == 0.0
    with pytest.raises(KeyError, match="controller.tell_run_ovr"):
        sweep_cells.load("configs/tiny_arith.py", ["controller.tell_run_ovr=False"])
