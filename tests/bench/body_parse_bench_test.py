"""bench.body_parse at a tiny size (1 MiB submissions, a few heartbeats; the real controller
over HTTP, its parser processes): the JSON has the headline taken from its rows, every
heartbeat was answered and every submission parsed (404: its lease is unknown)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_tiny_run_writes_the_headline_from_its_rows(tmp_path):
    out = tmp_path / "body_parse.json"
    cmd = [
        sys.executable, "-m", "bench.body_parse", f"--out={out}", "--body_mib=1",
        "--submitters=2", "--rounds=1", "--idle_heartbeats=20", "--pace_ms=20",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": ROOT}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    head, rows = result["headline"], {r["phase"]: r for r in result["rows"]}
    assert set(rows) == {"idle", "submissions"}
    assert rows["idle"]["n"] >= 20 and rows["submissions"]["n"] >= 1
    assert rows["submissions"]["submissions"] == 2 and rows["submissions"]["submit_status"] == [404]
    assert head["heartbeat_p99_ms_idle"] == rows["idle"]["p99_ms"] > 0
    assert head["heartbeat_p99_ms_submissions"] == rows["submissions"]["p99_ms"] > 0
    ratio = rows["submissions"]["p99_ms"] / rows["idle"]["p99_ms"]
    assert abs(head["heartbeat_p99_ratio"] - ratio) <= 5e-4 * (1 + 1e-9)  # rounded to 3 places
    assert 1 << 20 >= head["body_bytes"] > (1 << 20) * 0.9
    busy = rows["submissions"]
    idle_rate = rows["idle"]["server_cpu_s"] / rows["idle"]["wall_s"]
    per = (busy["server_cpu_s"] - idle_rate * busy["wall_s"]) / 2
    assert abs(busy["server_cpu_ms_per_submission"] - 1000 * per) <= 5e-3 * (1 + 1e-9)


def test_leased_run_posts_valid_submissions_through_the_whole_submit_path(tmp_path):
    """--leased_trajectories: each body is for a lease its submitter holds, so each is
    checked, scored and accepted (200), and `leased_submissions` reports the heartbeats and
    the CPU each Controller.submit call cost beside the headline."""
    out = tmp_path / "body_parse_leased.json"
    cmd = [
        sys.executable, "-m", "bench.body_parse", f"--out={out}", "--leased_trajectories=2",
        "--submitters=2", "--rounds=1", "--idle_heartbeats=20", "--pace_ms=20",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": ROOT}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    head, leased = result["headline"], result["leased_submissions"]
    rows = {r["phase"]: r for r in result["rows"]}
    assert rows["submissions"]["submit_status"] == [200] and leased["accepted"]
    assert leased["trajectories"] == 2 and leased["tokens_per_trajectory"] == 16384
    assert leased["heartbeat_p99_ratio_leased"] == head["heartbeat_p99_ratio"]
    assert leased["heartbeat_p50_ms_idle"] == rows["idle"]["p50_ms"]
    assert leased["heartbeat_p99_ms_submissions"] == rows["submissions"]["p99_ms"]
    assert len(leased["submit_cpu_s_each"]) == 2 and len(leased["first_submit_cpu_s"]) == 1
    assert all(x > 0 for x in leased["submit_cpu_s_each"])
