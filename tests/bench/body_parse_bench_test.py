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
