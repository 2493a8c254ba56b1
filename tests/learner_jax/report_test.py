"""End-of-run report from the run's files: PNGs, summary numbers, the live line."""

import json
import os

from learner_jax import report


def _write(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def test_report_from_run_files(tmp_path):
    wd = str(tmp_path)
    rows = [{"step": 5, "phase": "sft", "loss": 1.0}]
    for i in range(20):
        rows.append(
            {
                "step": 10 + i,
                "phase": "rl",
                "reward/mean": 0.1 if i < 10 else 0.5,
                "learner/utilization": 0.8,
                "staleness/mean": 1.0,
                "staleness/max": 2,
                "staleness/dropped": 3,
                "staleness/lag_1": 48.0,
                "staleness/lag_2": 16.0,
                "cost/usd": 0.001 * i,
                "mismatch/kl": 1e-9,
                "mismatch/tokens": 10.0,
                "time/wall": 1000.0 + 2 * i,
                "bridge/publish_blocking_s": 0.001 * (i + 1),
                "bridge/publish_skipped": i // 10,
                "bridge/version_bytes": 40_000 + 1000 * i,  # delta versions (bridge/weights/)
                "bridge/delta_density": 0.02,
            }
        )
    rows.append(dict(rows[-1], **{"reward/mean": 0.9}))  # a resumed run repeats step 29
    _write(os.path.join(wd, "metrics.jsonl"), rows)
    _write(
        os.path.join(wd, "eval.jsonl"),
        [
            {"tag": "before", "step": 9, "accuracy": 0.2},
            {"tag": "rl", "step": 19, "accuracy": 0.3},
            {"tag": "after", "step": 29, "accuracy": 0.55},
        ],
    )
    _write(
        os.path.join(wd, "swaps.jsonl"),
        [
            {
                "worker_id": "w-a",
                "price_per_hour": 0.4,
                "version": v,
                "seen_at": v + 0.5,
                "published_at": float(v),
            }  # fmt: skip
            for v in range(10, 20)
        ]
        + [
            {
                "worker_id": "w-b",
                "price_per_hour": 0.15,
                "version": 10,
                "seen_at": 11.0,
                "published_at": 9.0,
            }
        ],  # fmt: skip
    )
    # A chain of two: w-a reads the model (1 MB) from the store, w-b only manifests from it.
    fetch = dict(published_at=0.0, done_at=0.0)
    _write(
        os.path.join(wd, "broadcast.jsonl"),
        [dict(fetch, worker_id="w-a", version=v, latency_s=0.3, bytes_from_store=10**6 + 2000,
              bytes_from_peers=0) for v in (10, 11, 12)]
        + [dict(fetch, worker_id="w-b", version=v, latency_s=0.5 + v % 2, bytes_from_store=2000,
                bytes_from_peers=10**6) for v in (10, 11)],
    )  # fmt: skip
    path = report.write_report(wd)
    text = open(path).read()
    assert "broadcast, w-a: publish -> verified median 0.30 s, 1.002 MB from the store" in text
    assert "broadcast, w-b: publish -> verified median 1.00 s, 0.002 MB from the store and " \
        "1.000 MB from peers per version (2 versions)" in text  # fmt: skip
    assert "store bytes per version, all workers: median 1.004 MB = 1.00 model copies" in text
    assert "after SFT (step 9): 0.200" in text
    assert "after RL (step 29): 0.550" in text
    assert "+35.0 points" in text
    assert "RL steps: 20 (steps 10..29)" in text
    assert "RL wall time: 38 s" in text
    assert "first 2 steps 0.100, last 2 steps 0.700" in text  # the repeated step's last line
    assert "w-a ($0.40/h): median 0.50 s over 10 versions" in text
    assert "w-b ($0.15/h): median 2.00 s over 1 versions" in text
    assert "in the background: median 0.01" in text  # of 0.001..0.020 s
    assert "1 versions skipped" in text
    # 40k..59k bytes over steps 10..29 (the repeated step counted once): median 50 kB.
    assert "bytes per version: median 0.050 MB (max 0.059 MB) over 20 publishing steps" in text
    assert "changed elements median 2.00%" in text
    for name in ("reward.png", "utilization.png", "staleness.png", "swap_latency.png", "cost.png"):
        with open(os.path.join(wd, name), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", name


def test_live_line():
    line = report.live_line(
        {
            "step": 12,
            "reward/mean": 0.25,
            "eval/accuracy": 0.5,
            "staleness/mean": 1.5,
            "staleness/max": 2,
            "learner/utilization": 0.9,
            "fleet/active_workers": 2,
            "cost/usd": 0.0123,
            "time/wait_s": 0.1,
        },
        100,
    )
    assert line.startswith("step    12/100 | reward 0.250 | acc 0.500 | stale 1.50/2 | util 0.90")
    assert "workers 2 |" in line and "$0.0123" in line
    slow = report.live_line({"step": 1, "fleet/active_workers": 2, "fleet/too_slow_workers": 1}, 2)
    assert "workers 2 (1 too slow) |" in slow
    assert "acc   -" in report.live_line({"step": 1}, 2)
    assert "capacity" not in line
    short = {"capacity/warning": 1, "capacity/min_staleness": 4}
    short |= {"capacity/required_rollouts_per_s": 500.0, "capacity/active_rollouts_per_s": 300.0}
    assert report.live_line({"step": 1, **short}, 2).endswith(
        "| capacity: needs more workers (see log)"
    )
    fresh = {**short, "capacity/active_rollouts_per_s": 600.0}
    assert report.live_line({"step": 1, **fresh}, 2).endswith("| capacity: needs S>=4 (see log)")


def test_summary_reports_predicted_vs_measured_utilization():
    def row(step, util, **cap):
        return {"step": step, "reward/mean": 0.5, "learner/utilization": util,
                "time/step_s": 0.2, **cap}  # fmt: skip

    # Steps 1-2 cold (numbers shown, no verdict); confident from step 3 on: three steps
    # that trained 0.2 s of 0.25 s and one that waited 0.8 s. Utilization is train time
    # over wall time, 0.8 s / 1.75 s = 0.457 (a plain mean of the ratios would say 0.650).
    rows = [row(1, 0.1, **{"capacity/predicted_utilization": 0.4})]
    rows.append(row(2, 0.9, **{"capacity/predicted_utilization": 0.5}))
    rows += [
        row(s, u, **{"capacity/predicted_utilization": 0.75, "capacity/confident": 1})
        for s, u in zip(range(3, 7), (0.8, 0.8, 0.2, 0.8), strict=True)
    ]
    rows[-1]["capacity/warning"] = 1
    # A step whose window held an XLA compile (1 s of 1.25 s): a one-off the steady-state
    # prediction leaves out, and so does the measurement it is judged against.
    rows.append(row(7, 0.16, **{"capacity/predicted_utilization": 0.75, "capacity/confident": 1}))
    rows[-1]["time/compiled"] = 1
    text = report.summary(rows, [], {})
    assert (
        "- predicted vs measured utilization: 0.750 predicted vs 0.457 measured (+29.3 points) "
        "over the 4 steps with a confident prediction (the first at step 3: 0.750; 1 with an "
        "XLA compile left out); capacity warning on 1 of 7 steps"
    ) in text
    stops = [
        {"event": "stop", "name": "w1", "reason": "too slow: standby", "price_per_hour": 0.15,
         "cost_usd": 0.01, "idle_s": 90.0, "idle_usd": 0.00375},
        {"event": "stop", "name": "w0", "reason": "learner shutting down", "price_per_hour": 0.4},
    ]  # fmt: skip
    assert (
        "- released as too slow: 1 worker(s), w1 ($0.15/h); paid idle before release 90 s, "
        "$0.0037" in report.summary(rows, [], {}, (), stops)
    )
    none = report.summary(rows[:2], [], {})
    assert (
        # 0.4 s of train time over 2.0 + 0.22 s of wall time
        "utilization: no confident prediction (too few warm measurements); measured 0.180" in none
    )


def test_bytes_per_version_of_full_versions_says_so():
    """A run whose versions are all full (the demo: a local store, bridge.delta off) logs a
    density of 1.0 for each; the summary says they were full, not "100% changed"."""
    from learner_jax.report import version_bytes_lines

    rows = [{"bridge/version_bytes": 428_000, "bridge/delta_density": 1.0}] * 3
    [line] = version_bytes_lines(rows)
    assert "median 0.428 MB" in line and "every version full" in line and "%" not in line
    rows += [{"bridge/version_bytes": 9_000, "bridge/delta_density": 0.02}] * 2
    [line] = version_bytes_lines(rows)
    assert "changed elements median 2.00% over 2 delta versions" in line
    assert version_bytes_lines([{"loss": 1.0}]) == []
