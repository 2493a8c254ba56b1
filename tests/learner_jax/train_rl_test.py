"""The main job, shortened: `python -m learner_jax.train` with the demo config, through the
same code path as `make demo` (SFT warm start, real controller over HTTP, real file weight
bridge, two real vLLM worker processes, async GRPO with S=2).

The run is interrupted with SIGINT after a few RL steps (it must exit cleanly with a
checkpoint) and then resumed with the same command to the end. Asserted: every contract
metric on every RL line, held-out evaluation before/during/after, the report files, that
answer correctness rises by a margin a 30x weaker learner misses, and that the workers'
behaviour log-probs match the learner's to float32 rounding (`mismatch/kl`).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import observe_checks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONTRACT = (
    "step",
    "policy_version",
    "reward/mean",
    "staleness/mean",
    "staleness/max",
    "staleness/dropped",
    "mismatch/kl",
    "learner/utilization",
    "time/step_s",
    "time/wait_s",
    "bridge/publish_s",
    "fleet/active_workers",
    "fleet/rollouts_per_s",
    "cost/usd",
)
# Shortened demo: same binary and config, few steps, the 2 x 64 tiny shape (the demo's
# 4 x 128 costs ~8x the compute per step for no extra coverage). The demo's story in small:
# a short SFT warm start on one-digit +/- from the config's sloppy teacher (answers one too
# high 70% of the time), so the policy samples the right answer ~30% of the time, then RL
# against the exact reward. Measured (2 shared cores), answer correctness (reward/correct)
# before (first 3 steps) -> after (last 10): 0.29 -> 0.57 and 0.29 -> 0.60 at lr 5e-4 (1e-3
# and 2e-3 learn less: too large for these batches); with every update divided by 30,
# 0.28 -> 0.39 (Adam's normalized steps still move a tiny model a little).
RL_STEPS = 40
ARGS = [
    f"--config.total_steps={RL_STEPS}",
    "--config.model.tiny_num_layers=2",
    "--config.model.tiny_hidden_size=64",
    "--config.model.tiny_intermediate_size=128",
    "--config.task.digits=1",
    "--config.sft.steps=300",
    "--config.optimizer.learning_rate=5e-4",
    "--config.optimizer.warmup_steps=0",
    "--config.checkpoint.interval=10",
    # The relay chain through the binary (the demo's "auto" picks "store" for its local
    # store; remote stores get the chain).
    "--config.bridge.broadcast=chain",
    *observe_checks.WANDB_ARGS,  # W&B offline beside metrics.jsonl
]
# Answer correctness must rise at least this much: between the 30x weaker learner's 0.11
# and the learner's 0.28-0.31, ~3 standard deviations of the difference (~0.03: per-step
# noise ~0.05 over a 3-step and a 10-step mean) from each.
CORRECT_RISE = 0.2
# mismatch/kl is the mean per-token k3 = exp(d) - 1 - d ~ d^2 / 2 of the gap d between a
# worker's behaviour log-prob and the learner's, on rows the learner's own version sampled.
# Here both sides compute in float32 (the tiny model; workers run --dtype=float32), so d is
# rounding: the canary's max |d| is ~1e-6 (k3 ~5e-13; measured means 1e-14..4e-12). A mean
# above 1e-8 needs typical gaps above 1.4e-4, 100x the rounding: not rounding any more but
# a different distribution (another version, temperature or dtype: bf16 rounds logits to
# ~3 significant digits, gaps ~1e-3 and up, k3 ~5e-7 and up).
KL_BOUND = 1e-8


def _env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the demo runs on one device, as on a user's machine
    env["PYTHONUNBUFFERED"] = "1"
    env["WANDB_SILENT"] = "true"
    return env


def _cmd(workdir):
    return [
        sys.executable,
        "-m",
        "learner_jax.train",
        "--config=configs/tiny_arith.py",
        f"--workdir={workdir}",
        *ARGS,
    ]


def _rl_rows(workdir):
    rows = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if row.get("phase") == "rl":
                rows[row["step"]] = row
    return [rows[s] for s in sorted(rows)]


@pytest.mark.slow
@pytest.mark.vllm
def test_short_demo_interrupt_resume_and_reward_rises(tmp_path):
    workdir = str(tmp_path / "run")
    log1 = open(tmp_path / "run1.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        _cmd(workdir), cwd=ROOT, env=_env(), stdout=log1, stderr=subprocess.STDOUT
    )
    try:
        # Interrupt once a few RL steps are logged, as a user's Ctrl-C would.
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            if (
                os.path.exists(os.path.join(workdir, "metrics.jsonl"))
                and len(_rl_rows(workdir)) >= 5
            ):
                break
            time.sleep(1)
        assert proc.poll() is None, (tmp_path / "run1.log").read_text()[-3000:]
        # The controller's Prometheus endpoint, live, agrees with `bridge.status`.
        scraped = observe_checks.assert_scrape_agrees_with_status(workdir)
        # Both workers are in the fleet. Which live state each is in is timing: on a loaded
        # machine a worker whose lease came back stale is refused as too_slow and put on
        # standby (bridge/control/leasing/lease_timing.py), a correct answer the scrape must show.
        states = {k[1][0][1]: v for k, v in scraped.items() if k[0] == "echo2_workers"}
        assert states["active"] >= 1, states
        assert sum(states.get(s, 0) for s in ("active", "standby", "too_slow")) == 2, states
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0, (tmp_path / "run1.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        log1.close()
    stopped_at = _rl_rows(workdir)[-1]["step"]
    first_end = len(_rl_rows(workdir))
    assert first_end < RL_STEPS

    run2 = subprocess.run(
        _cmd(workdir), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900
    )
    assert run2.returncode == 0, run2.stdout[-3000:] + run2.stderr[-3000:]
    assert "resumed from step" in run2.stderr
    assert f"step {stopped_at + 1:>5}/" in run2.stdout  # continued where it stopped
    assert "report: " in run2.stdout and "# echo2 run summary" in run2.stdout
    assert "resolved config:" not in run2.stdout + run2.stderr  # at DEBUG, in train.log only
    with open(os.path.join(workdir, "train.log")) as f:
        log = f.read()
    assert "resolved config:" in log and log.count("resumed from step") == 1

    rows = _rl_rows(workdir)
    steps = [r["step"] for r in rows]
    assert steps == list(range(steps[0], steps[0] + RL_STEPS))
    for r in rows:
        missing = [k for k in CONTRACT if r.get(k) is None]
        assert not missing, (r["step"], missing)
        assert r["staleness/max"] <= 2
        assert 0.0 <= r["learner/utilization"] <= 1.0
    end = rows[-1]  # both workers back after the resume (one may be on standby, as above)
    assert end["fleet/active_workers"] >= 1
    assert end["fleet/active_workers"] + end["fleet/standby_workers"] == 2, end
    assert rows[-1]["cost/usd"] > 0
    assert any("eval/accuracy" in r for r in rows)
    assert max(r["staleness/max"] for r in rows) >= 1  # it really ran asynchronously

    kl = [r["mismatch/kl"] for r in rows]
    assert max(kl) <= KL_BOUND, kl  # learner and workers score the same float32 model
    # Correctness, not the reward: reward/correct counts samples with the full reward only.
    # Before: the first steps' batches, sampled by the SFT policy itself (S = 2: versions
    # at most 2 updates old); after: the last 10 steps.
    correct = [r["reward/correct"] for r in rows]
    before, after = sum(correct[:3]) / 3, sum(correct[-10:]) / 10
    print("reward/correct:", " ".join(f"{c:.3f}" for c in correct))
    print(f"reward/correct: before {before:.4f}, after {after:.4f}")
    assert after - before >= CORRECT_RISE, (before, after)

    with open(os.path.join(workdir, "eval.jsonl")) as f:
        evals = [json.loads(line) for line in f]
    print("held-out accuracy:", [(e["tag"], e["step"], round(e["accuracy"], 3)) for e in evals])
    tags = {e["tag"] for e in evals}
    assert {"before", "after"} <= tags
    for name in ("summary.md", "reward.png", "utilization.png", "staleness.png", "cost.png"):
        assert os.path.getsize(os.path.join(workdir, name)) > 0, name
    assert os.path.exists(os.path.join(workdir, "swap_latency.png"))
    assert os.listdir(os.path.join(workdir, "tb"))
    # W&B (offline): one run resumed across the interrupt, every line as in metrics.jsonl.
    wandb_run = observe_checks.assert_wandb_matches_metrics(workdir)
    assert {"eval/table", "plots/reward"} <= set(wandb_run["media"])
    with open(os.path.join(workdir, "controller.json")) as f:
        assert json.load(f)["url"].startswith("http://")

    # Broadcast along a chain: one worker reads each version from the
    # store, the other from its relay; the summary says so per worker and per version.
    with open(os.path.join(workdir, "summary.md")) as f:
        summary = f.read()
    assert summary.count("- broadcast, w-") >= 2, summary  # 2 workers per run, 2 runs
    assert "from peers per version" in summary and "model copies" in summary
    fetches = [json.loads(line) for line in open(os.path.join(workdir, "broadcast.jsonl"))]
    model = max(r["bytes_from_store"] + r["bytes_from_peers"] for r in fetches)
    from_peers = [r for r in fetches if r["bytes_from_peers"] >= 0.9 * model]
    assert len(from_peers) >= len(fetches) // 4, fetches[-6:]  # not all fell back to the store
    copies = [r["broadcast/store_bytes"] / model for r in rows if "broadcast/store_bytes" in r]
    assert copies and min(copies) <= 1.05, copies  # one copy per version (2 in store mode)
