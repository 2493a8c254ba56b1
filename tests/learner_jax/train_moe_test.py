"""configs/qwen3_moe_shaped.py, shortened: the training binary with a tiny Qwen3-MoE, its
controller, one bf16 vLLM worker process, delta versions and routing replay on.

Asserted: every RL line reports the replayed and the learner's own mismatch KL on the same
tokens (the step's own `mismatch/kl` is the replayed one) and per-layer routing agreement
within the audit's line (an honest bf16 engine differs on ~0.6% of expert slots,
bridge/contracts/routing.py); nobody is quarantined; versions after the first are stored as
deltas and the worker served them; the fleet evaluates the final version.
"""

import glob
import json
import os
import sqlite3
import subprocess
import sys

import pytest

from bridge.contracts import routing
from bridge.store.weight_store import WeightStore

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 3


@pytest.mark.slow
@pytest.mark.vllm
def test_moe_run_replays_routing_through_the_whole_system(tmp_path):
    workdir = str(tmp_path / "run")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)  # one device, as a user's run
    cmd = [sys.executable, "-m", "learner_jax.train", "--config=configs/qwen3_moe_shaped.py",
           f"--workdir={workdir}", f"--config.total_steps={STEPS}"]  # fmt: skip
    with open(tmp_path / "run.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            timeout=1500).returncode  # fmt: skip
    assert rc == 0, (tmp_path / "run.log").read_text()[-3000:]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if r.get("phase") == "rl"]
    assert len(rows) == STEPS
    for r in rows:
        assert r["mismatch/tokens"] > 0
        assert r["mismatch/kl"] == r["mismatch/kl_replay"]  # replay on: the step's own
        assert r["mismatch/kl_no_replay"] > 0
        layers = [k for k in r if k.startswith("moe/routing_agreement/layer_")]
        assert len(layers) == 2
        assert min(r[k] for k in layers) > 1 - routing.DISAGREE_THRESHOLD, r
    with sqlite3.connect(os.path.join(workdir, "controller.db")) as db:
        assert db.execute("SELECT COUNT(*) FROM quarantine").fetchone()[0] == 0
    store = WeightStore(os.path.join(workdir, "weights"))
    assert not store.manifest(STEPS - 1).is_full  # a delta version ...
    logs = glob.glob(os.path.join(workdir, "workers", "*.log"))  # a replaced worker too
    assert any(f"now serving version {STEPS - 1}" in open(p).read() for p in logs)  # loaded
    # The fleet evaluated the final version (its MoE routing checked, not refused).
    with open(os.path.join(workdir, "eval.jsonl")) as f:
        assert STEPS in [json.loads(line).get("version") for line in f]
