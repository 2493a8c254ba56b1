"""bench.controller_load --sweep at a tiny size (two arms of a few workers for seconds, the
real controller, HTTP and SQLite audit): the JSON has the bench contract's headline keys
(DESIGN.md) taken from its rows; and the headline's baseline ratios from given rows."""

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("aiohttp")  # the simulated workers' HTTP client (the worker extras)
pytest.importorskip("psutil")

from bench import controller_sweep  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = {"p99_ms_2000", "p99_ms_500_fast", "submissions_per_s_500_fast", "audit_clean", "errors_5xx"}


def test_tiny_sweep_writes_the_headline_from_its_rows(tmp_path):
    out = tmp_path / "sweep.json"
    cmd = [
        sys.executable, "-m", "bench.controller_load", "--sweep", f"--out={out}",
        "--arms=500_fast:6@0.2,2000:6@0.5", "--duration_s=3", "--ramp_s=1",
        "--groups_per_step=8",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": ROOT}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    head, rows = result["headline"], {r["arm"]: r for r in result["rows"]}
    assert set(head) == KEYS  # no baseline: no ratio keys
    assert set(rows) == {"500_fast", "2000"}
    assert result["commits"]["new"].split("+")[0], result["commits"]  # numbers name a commit
    for row in rows.values():
        assert "error" not in row, row.get("error")
        assert row["tree"] == "new" and row["audit_ok"] is True and row["server_5xx"] == 0
        worst = max(row["endpoints"][ep]["p99_ms"] for ep in controller_sweep.ENDPOINTS)
        assert row["p99_ms"] == worst > 0
    assert head["p99_ms_2000"] == rows["2000"]["p99_ms"]
    assert head["p99_ms_500_fast"] == rows["500_fast"]["p99_ms"]
    # The rate counts the steady window only: a 3-second arm on a busy box may see none
    # there, so this checks where the headline comes from, not how fast the box is.
    assert head["submissions_per_s_500_fast"] == rows["500_fast"]["submissions_per_s"] >= 0
    assert head["audit_clean"] is True and head["errors_5xx"] == 0


def _row(arm, tree, p99, subm, audit_ok=True, fivexx=0):
    return {"arm": arm, "tree": tree, "p99_ms": p99, "submissions_per_s": subm,
            "audit_ok": audit_ok, "server_5xx": fivexx}  # fmt: skip


def test_headline_ratios_are_ours_over_the_baseline_per_arm():
    rows = [
        _row("500_fast", "new", 100.0, 240.0),
        _row("500_fast", "baseline", 400.0, 160.0, fivexx=2),
        _row("2000", "new", 30.0, 32.0),
        _row("2000", "baseline", 60.0, 32.0, audit_ok=False),
    ]
    head = controller_sweep.headline(rows)
    assert head["ratio_p99_ms_500_fast"] == 0.25
    assert head["ratio_p99_ms_2000"] == 0.5
    assert head["ratio_submissions_per_s_500_fast"] == 1.5
    assert head["audit_clean"] is True and head["audit_clean_baseline"] is False
    assert head["errors_5xx"] == 0 and head["errors_5xx_baseline"] == 2
    assert rows[0]["ratio_p99_ms"] == 0.25 and rows[0]["ratio_submissions_per_s"] == 1.5
    assert "ratio_p99_ms" not in rows[1]  # the baseline's own rows carry none
    assert not math.isnan(rows[2]["ratio_p99_ms"])
