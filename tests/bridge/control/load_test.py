"""A CI-sized run of bench/controller_load.py: 50 simulated workers for a few seconds
against the real controller (SQLite, reward pool, HTTP with its abuse limits): no 5xx, no
transport error, and every accepted group in the database exactly once."""

import pytest

pytest.importorskip("aiohttp")  # the simulated workers' HTTP client (the worker extras)
pytest.importorskip("psutil")

from bench import controller_load  # noqa: E402


def test_fifty_workers_no_server_errors_and_exactly_once(tmp_path):
    args = controller_load.parse_args(
        [
            f"--out={tmp_path / 'load.json'}",
            f"--workdir={tmp_path}",
            "--workers=50",
            "--duration_s=8",
            "--ramp_s=2",
            "--gen_s=0.3",
            "--groups_per_step=16",
            "--max_groups=2",
        ]
    )
    r = controller_load.run(args)
    assert r["registered"] == 50
    assert r["server_5xx"] == 0 and r["transport_errors"] == 0, r["endpoints"]
    assert r["audit"]["ok"], r["audit"]["problems"]
    assert r["groups_accepted"] > 50 and r["learner_steps"] > 2
    # The default rate limits never slow an honest worker down.
    assert r["fleet/rate_limited"] == 0
