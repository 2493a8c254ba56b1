"""The training binary end to end: a sharded SFT run via subprocess, resume in the same
workdir, and the RL phase fed by a trajectory iterator (what the controller plugs into)."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from learner_jax import config_file, run_config, train
from learner_jax.model import sharding
from learner_jax.reporting import metrics as metrics_lib
from learner_jax.training import checkpoint, train_step
from tests import xla_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SFT_KEYS = {"step", "phase", "loss", "grad_norm", "entropy", "learning_rate", "time/step_s"}
SFT_KEYS |= {"time/wait_s", "learner/utilization", "token_accuracy"}


def tiny_test_config():
    return config_file.load_config(os.path.join(ROOT, "configs", "test_tiny.py"))


def run_binary(workdir, *overrides):
    env = xla_env.child_env(devices=8)
    cmd = [
        sys.executable,
        "-m",
        "learner_jax.train",
        "--config=configs/test_tiny.py",
        f"--workdir={workdir}",
        "--config.mesh.data=2",
        "--config.mesh.fsdp=2",
        "--config.mesh.tensor=2",
        *overrides,
    ]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def test_binary_sft_then_resume(tmp_path):
    wd = str(tmp_path / "run")
    p = run_binary(wd, "--config.sft.steps=2")
    # The console: a header, progress lines (stdout is a pipe here), no config dump and no
    # JAX backend probing; train.log has all of it.
    assert f"workdir  {wd}" in p.stdout and f"tensorboard --logdir {wd}/tb" in p.stdout
    assert "SFT 100% | step     2/2 | loss " in p.stdout
    assert "resolved config:" not in p.stdout + p.stderr
    assert "Unable to initialize backend" not in p.stderr
    with open(os.path.join(wd, "train.log")) as f:
        log = f.read()
    assert "resolved config:" in log and "sft step 2 loss" in log
    with open(os.path.join(wd, "config.json")) as f:
        resolved = json.load(f)
    assert resolved["sft"]["steps"] == 2 and resolved["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
    assert os.path.exists(os.path.join(wd, "model", "config.json"))  # tiny model built
    rows = metrics_lib.read_metrics(wd)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert SFT_KEYS <= set(r), SFT_KEYS - set(r)
        assert r["phase"] == "sft" and np.isfinite(r["loss"]) and r["tokens"] > 0
    # Step dirs plus the HF config/tokenizer copy bridge.export reads.
    assert sorted(os.listdir(os.path.join(wd, "checkpoints"))) == ["2", "hf_model"]
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(os.path.join(wd, "tb")))

    # Same workdir, more steps: resumes at 2 (SFT cursor included), runs only step 3.
    p = run_binary(wd, "--config.sft.steps=3")
    assert "resumed from step 2 (sft)" in p.stderr
    rows = metrics_lib.read_metrics(wd)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {
        "workdir": wd,
        "step": 3,
        "phase": "sft",
    }
    assert "3" in os.listdir(os.path.join(wd, "checkpoints"))  # final step always saved


def test_bad_override_fails_cleanly(tmp_path):
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "learner_jax.train", "--config=configs/test_tiny.py"]
    cmd += [f"--workdir={tmp_path}", "--config.no_such_key=1"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "no_such_key" in p.stderr
    assert os.listdir(tmp_path) == []  # nothing written


def _rl_items(n, rows, length, vocab):
    rng = np.random.default_rng(0)
    for i in range(n):
        tokens = rng.integers(3, vocab, (rows, length + 1))
        loss_mask = np.zeros_like(tokens)
        loss_mask[:, 5:] = 1
        batch = train_step.make_batch(
            tokens,
            loss_mask,
            behavior_logp=-4.8 + 0.1 * rng.standard_normal((rows, length)),
            advantages=rng.standard_normal(rows),
            on_policy=np.ones(rows),
        )
        yield batch, {"policy_version": i, "reward/mean": 0.5}, {"next_prompt": 8 * (i + 1)}


def test_sft_then_rl_phase_in_process(tmp_path):
    config = tiny_test_config()
    config.sft.steps = 1
    config.total_steps = 2
    config.loss.name = "dapo"
    wd = str(tmp_path)
    learner = train.run(config, wd, items=_rl_items(5, 8, 12, 100))
    assert learner.step == 3 and learner.phase == "rl" and learner.rl_steps == 2
    rows = metrics_lib.read_metrics(wd)
    assert [(r["step"], r["phase"]) for r in rows] == [(1, "sft"), (2, "rl"), (3, "rl")]
    rl_keys = {"loss", "grad_norm", "clip_frac", "is_weight/mean", "is_weight/max", "entropy"}
    rl_keys |= {"mismatch/kl", "policy_version", "reward/mean", "learner/utilization"}
    for r in rows[1:]:
        assert rl_keys <= set(r), rl_keys - set(r)
    assert rows[2]["policy_version"] == 1
    # The RL phase restarted the optimizer schedule: warmup from 0 at its first update.
    assert rows[1]["learning_rate"] == 0.0 and rows[2]["learning_rate"] > 0
    ckpt = checkpoint.Checkpointer(checkpoint.checkpoint_dir(wd))
    assert ckpt.latest_step() == 3
    _, cursor = ckpt.restore(learner.abstract)
    assert cursor["phase"] == "rl" and cursor["rl_start_step"] == 1
    assert cursor["rl"] == {"next_prompt": 16}


def test_after_step_hooks_run_in_order_and_their_metrics_are_logged(tmp_path):
    """The RL loop knows its parts only as `AfterStep` hooks (learner_jax/rl/hooks.py): each
    runs after every update, sees the new step and what the hooks before it returned."""
    from learner_jax.learner import Learner

    config = tiny_test_config()
    config.sft.steps, config.total_steps = 0, 2
    calls = []

    class Hook:
        def __init__(self, name):
            self.name = name

        def after_step(self, learner, metrics):
            seen = sorted(k for k in metrics if k.startswith("hook/"))
            calls.append((self.name, learner.step, seen))
            return {f"hook/{self.name}": float(learner.step)}

    learner = Learner(config, str(tmp_path))
    try:
        train.run_rl(learner, _rl_items(5, 8, 12, 100), [Hook("a"), Hook("b")])
    finally:
        learner.close()
    assert calls == [("a", 1, []), ("b", 1, ["hook/a"]), ("a", 2, []), ("b", 2, ["hook/a"])]
    rows = metrics_lib.read_metrics(str(tmp_path))
    assert [(r["step"], r["hook/a"], r["hook/b"]) for r in rows] == [(1, 1, 1), (2, 2, 2)]


def test_batch_sizes_checked_before_compile():
    config = tiny_test_config()
    config.sft.micro_batch_size = 3
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    with pytest.raises(ValueError, match="sft: micro-batch size 3"):
        run_config.check_batch_sizes(config, mesh)


def test_bad_config_writes_nothing(tmp_path):
    config = tiny_test_config()
    config.loss.name = "no_such_loss"
    with pytest.raises(ValueError, match="unknown loss"):
        train.run(config, str(tmp_path / "wd"))
    assert not (tmp_path / "wd").exists()


def test_kl_penalty_anchors_to_the_policy_the_rl_phase_started_from(tmp_path):
    """loss.kl_coef > 0: the reference is the params at the RL boundary, saved once beside
    the checkpoints and restored (not re-taken) on resume; the `kl` metric starts at 0
    (policy == reference) and grows as RL moves the policy; a run whose RL phase began
    without the penalty cannot add it on resume (no reference: a clear error)."""
    from learner_jax.learner import Learner
    from learner_jax.training import reference_policy

    config = tiny_test_config()
    config.sft.steps, config.total_steps = 1, 4
    config.optimizer.warmup_steps = 0
    config.checkpoint.keep = 10  # keep the boundary's checkpoint to compare with
    config.loss.kl_coef, config.loss.kl_end_fraction = 0.5, 0.2  # beta: cosine 0.5 -> 0.1
    wd = str(tmp_path / "kl")
    learner = train.run(config, wd, items=_rl_items(5, 8, 12, 100))
    assert learner.step == 5 and os.path.isdir(reference_policy.path(wd))
    at_boundary, _ = checkpoint.Checkpointer(checkpoint.checkpoint_dir(wd)).restore(
        learner.abstract, step=1
    )

    def same(a, b):
        return all(
            np.array_equal(x, y)
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
        )

    assert same(jax.device_get(learner.reference), jax.device_get(at_boundary.params))
    assert not same(jax.device_get(learner.state.params), jax.device_get(at_boundary.params))
    rl_rows = [r for r in metrics_lib.read_metrics(wd) if r["phase"] == "rl"]
    kl = [r["kl"] for r in rl_rows]
    assert kl[0] < 1e-9 and min(kl[1:]) > 1e-6, kl  # k3 of float32 noise is ~1e-14
    # The schedule: a cosine over total_steps (4) from kl_coef to kl_coef * kl_end_fraction.
    betas = [0.1 + 0.4 * 0.5 * (1 + np.cos(np.pi * t / 4)) for t in range(4)]
    assert np.allclose([r["kl_coef"] for r in rl_rows], betas), rl_rows
    resumed = Learner(config, wd)  # at step 5: the reference comes back from disk
    try:
        assert same(jax.device_get(resumed.reference), jax.device_get(at_boundary.params))
    finally:
        resumed.close()

    assert reference_policy.kl_scale(config.loss, 9, 4) == 0.2  # flat after total_steps
    config.loss.kl_coef = 0.0
    plain = str(tmp_path / "plain")
    train.run(config, plain, items=_rl_items(2, 8, 12, 100)).close()
    config.loss.kl_coef = 0.5
    with pytest.raises(FileNotFoundError, match="began without the KL penalty"):
        Learner(config, plain)
