"""bench/moe.py at a small width (8 of 32 experts, hidden 256): the arms run, the dense arm
has the MoE's active parameters, the expert-sharded block equals the single-device one,
and the headline is computed from the rows."""

import json
import os
import subprocess
import sys

from bench import moe as moe_bench


def test_small_bench_writes_its_headline(tmp_path):
    out = tmp_path / "moe.json"
    # As users run it: in its own process at XLA's default optimization (the suite compiles
    # at level 0, which reorders the sharded sums past the bench's 256-ulp limit).
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    args = ["--out", str(out), "--shape=small", "--tokens=64", "--steps=1", "--ep_tokens=32"]
    subprocess.run([sys.executable, "-m", "bench.moe", *args], env=env, check=True, timeout=600)
    result = json.loads(out.read_text())
    head, rows = result["headline"], {r["arm"]: r for r in result["rows"]}
    assert set(head) == {"moe_vs_dense_active_time", "ep_sharded_equals_single", "replay_kl_ratio"}
    assert head["replay_kl_ratio"] is None  # the end-to-end run's number, not this bench's
    dense, sparse = rows["dense_same_active"], rows["moe_blocks"]
    assert head["moe_vs_dense_active_time"] == sparse["step_s"] / dense["step_s"]
    # Same active matmul FLOPs; the MoE adds only its router (2 x tokens x D x E, x3).
    cfg = moe_bench.layer_config("small")
    router = 3 * 2 * 64 * cfg.hidden_size * cfg.num_experts / 1e9
    assert abs(sparse["gflops"] - dense["gflops"] - router) < 1e-9
    # All experts resident: E / k times the dense block's parameters, plus the router.
    ratio = cfg.num_experts / cfg.num_experts_per_tok
    assert sparse["param_bytes"] > ratio * dense["param_bytes"]
    ep = rows["ep_sharded"]
    assert ep["experts_per_device"] == cfg.num_experts // 8
    assert head["ep_sharded_equals_single"] is True and ep["worst_ulps"] <= moe_bench.ULPS
