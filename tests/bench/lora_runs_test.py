"""bench/lora_runs.py reads two training runs' files (metrics.jsonl, eval.jsonl,
swaps.jsonl) into the side-by-side rows of bench.lora: medians over the RL steps only,
the held-out accuracy before RL and at the end, swap time = served - announced."""

import json

import pytest

from bench import lora_runs


def write_run(path, version_bytes, step_s, swap_s, final):
    path.mkdir()
    rows = [{"step": 1, "phase": "sft", "time/step_s": 99.0, "time/wall": 0.0}]
    rows += [
        {"step": 2 + i, "phase": "rl", "time/step_s": step_s + i, "time/wall": 10.0 + i,
         "bridge/version_bytes": version_bytes}
        for i in range(3)
    ]  # fmt: skip
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evals = [{"tag": "before", "accuracy": 0.1}, {"tag": "rl", "accuracy": 0.99},
             {"tag": "after", "accuracy": final}]  # fmt: skip
    (path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    swaps = [{"published_at": 5.0, "seen_at": 5.0 + swap_s * k} for k in (1, 2, 3)]
    (path / "swaps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in swaps))
    return str(path)


def test_two_runs_side_by_side(tmp_path):
    lo = write_run(tmp_path / "l", 1000, 1.0, 0.5, 0.9)
    fu = write_run(tmp_path / "f", 4000, 2.0, 2.0, 0.95)
    rows, head = lora_runs.rows(lo, fu)
    got = {(r["arm"], r["what"]): r["value"] for r in rows}
    assert got["lora", "run_version_bytes"] == 1000 and got["full", "run_version_bytes"] == 4000
    assert got["lora", "run_rl_step_s_median"] == 2.0  # RL rows 1, 2, 3: not the SFT row's 99
    assert got["lora", "run_swap_s_median"] == 1.0 and got["lora", "run_swaps"] == 3
    assert got["full", "run_heldout_before"] == 0.1 and got["full", "run_heldout_final"] == 0.95
    assert got["lora", "run_rl_wall_s"] == 2.0 and got["lora", "run_rl_steps"] == 3
    assert got["full", "run_heldout_best"] == 0.99
    assert head["run_version_bytes_ratio"] == 0.25 and head["run_swap_ratio"] == 0.25
    assert head["run_step_time_ratio"] == pytest.approx(2.0 / 3.0)


def test_a_run_without_rl_is_refused(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"phase": "sft"}) + "\n")
    with pytest.raises(ValueError, match="no RL steps"):
        lora_runs.run_stats(str(tmp_path))


def test_table_shows_before_to_final_and_the_learner_rss(tmp_path):
    lo = write_run(tmp_path / "l", 1000, 1.0, 0.5, 0.97)
    fu = write_run(tmp_path / "f", 4000, 2.0, 2.0, 1.0)
    (tmp_path / "l" / "bench_rss.json").write_text(json.dumps({"peak_rss_bytes": 123456789}))
    text = lora_runs.table({"lora": lora_runs.run_stats(lo), "full": lora_runs.run_stats(fu)})
    lines = {line.split(" | ")[0]: line for line in text.splitlines()}
    assert (
        "0.100 -> 0.970 (best 0.990) | 0.100 -> 1.000 (best 1.000)"
        in lines["| held-out accuracy, before -> final"]
    )
    assert "| 123,456,789 | n/a |" in lines["| learner peak RSS, bytes"]
    assert "| 1,000 | 4,000 |" in lines["| bridge/version_bytes (median)"]


def test_fleet_eval_stats_reads_the_summaries(tmp_path):
    from bench import lora_demo

    evals = [{"tag": "fleet", "type": "summary", "version": 10, "accuracy": 0.5},
             {"tag": "fleet", "type": "prompt", "version": 10, "accuracy": 0.0},
             {"tag": "fleet", "type": "summary", "version": 20, "accuracy": 0.75}]  # fmt: skip
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    rows = [{"audit/eval_rows": 16.0, "fleet/quarantined": 0}, {"audit/eval_rows": 8.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = lora_demo.fleet_eval_stats(str(tmp_path))
    assert got == {"fleet_evals": {10: 0.5, 20: 0.75}, "audited_eval_rows": 24.0,
                   "max_quarantined": 0}  # fmt: skip
