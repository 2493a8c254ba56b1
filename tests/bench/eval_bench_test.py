"""bench.eval's learner arms on a short answer: the table and the JSON, and the cache-free
decoder's answers equal the KV cache's (the fleet arm needs a vLLM engine start: run by
hand, `python -m bench.eval --quick`)."""

import json

from bench import eval as eval_bench


def test_learner_arms_agree_and_the_json_is_written(tmp_path, capsys):
    out = tmp_path / "eval.json"
    result = eval_bench.main(
        ["--out", str(out), "--no_fleet", "--prompts", "3", "--answer_len", "12",
         "--workdir", str(tmp_path)]
    )  # fmt: skip
    written = json.loads(out.read_text())
    rows = {r["arm"]: r for r in written["rows"]}
    assert set(rows) == {"learner_kv_cache", "learner_no_cache"}
    for arm in rows.values():
        assert arm["tokens"] == 3 * 12  # the never-stop model answers to full length
        assert arm["same_as_cached"] == 3 and arm["common_prefix"] == 12.0
    assert result["answers"]["learner_kv_cache"] == result["answers"]["learner_no_cache"]
    # The headline keys the bench contract names (DESIGN.md), each from the rows.
    head = written["headline"]
    assert set(head) == {"kv_speedup", "same_answers", "fleet_vs_learner_tokens_per_s"}
    speeds = {name: r["tokens_per_s"] for name, r in rows.items()}
    assert head["kv_speedup"] == speeds["learner_kv_cache"] / speeds["learner_no_cache"]
    assert head["same_answers"] is True
    assert head["fleet_vs_learner_tokens_per_s"] is None  # --no_fleet
    assert "learner_no_cache" in capsys.readouterr().out
