"""Hold'em end to end, shortened: the training binary with configs/holdem.py, a real vLLM
worker process playing multi-turn hands through pokerkit, the controller replaying every
hand to score it, a few GRPO steps on the model's tokens only. Payoffs summing to zero per
hand and the replay's exactness are tested in tests/bridge/tasks/env_test.py and
tests/rollout_gpu/episodes_test.py; here the whole path must run and train."""

import json
import os
import sqlite3
import statistics
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
@pytest.mark.vllm
def test_holdem_runs_end_to_end_with_a_real_worker(tmp_path):
    workdir = str(tmp_path / "run")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("XLA_FLAGS", None)
    cmd = [
        sys.executable,
        "-m",
        "learner_jax.train",
        "--config=configs/holdem.py",
        f"--workdir={workdir}",
        "--config.total_steps=3",
        "--config.task.invalid=call",  # the untrained model stays in hands: long episodes
        "--config.batch.groups_per_step=4",
        "--config.batch.samples_per_group=4",
        "--config.batch.micro_batch_size=16",
        "--config.task.eval_size=8",
        "--config.rollout.eval_period=0",
    ]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    rl = [r for r in rows if r.get("phase") == "rl"]
    assert [r["step"] for r in rl] == [1, 2, 3]
    for r in rl:
        assert r["reward/errors"] == 0 and r["staleness/max"] <= 2
        # Several turns per hand: model tokens plus the observations between them.
        assert r["rollout/completion_len"] > 10, r
        assert r["tokens"] < r["rollout/completion_len"] * 16  # observations are masked out

    # The worker's speed meter counts the model's tokens, not the observations: its tokens
    # per sample match the batches' model tokens per sample, well below completion_len.
    with sqlite3.connect(os.path.join(workdir, "controller.db")) as db:
        meters = db.execute(
            "SELECT tokens_per_s, samples_per_s FROM workers WHERE samples_per_s > 0"
        ).fetchall()
    assert meters
    model_per_sample = statistics.fmean(r["tokens"] / 16 for r in rl)
    completion_len = statistics.fmean(r["rollout/completion_len"] for r in rl)
    for tokens_per_s, samples_per_s in meters:
        per_sample = tokens_per_s / samples_per_s
        print(f"meter {per_sample:.1f} model {model_per_sample:.1f} all {completion_len:.1f}")
        assert per_sample < 0.5 * (model_per_sample + completion_len), (per_sample, rl)
