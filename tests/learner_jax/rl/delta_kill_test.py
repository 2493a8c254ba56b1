"""SIGKILL of the learner in the middle of a delta chain, then a restart on the same workdir.

A child process (this file run as a script) is the training binary's RL loop with delta
versions on: the real `Learner` (restored from the workdir's newest checkpoint), the
binary's store (`weights.open_store`), publisher (`weights.WeightPublisher` with
`delta_config=config.bridge.delta`), first synchronous publish and `train.run_rl`
with the publish hook, on random RL batches. bf16 master weights, so a step changes only
some stored elements and versions are real patches (`bridge.publish_dtype` bf16 here;
published in fp32, every element moves and every tensor of a delta goes dense). Checkpoints every
2 steps; after each publish the child records the SHA-256 of every tensor it published
(computed from its params, not from the store).

Run 1 publishes 0 (full) and deltas 1..3, checkpoints 2, and is SIGKILLed after version 3
is announced. Run 2 (other batches, as a rerun's fleet would send) restores step 2, the
store drops 3, and it publishes 3..5. Asserted: version 3 of the rerun is a full version
with no patch (a fresh anchor: its publisher never held 2's tensors), 4 and 5 patch on
it; every version in the store, before and after the restart, reads back (through
`reconstruct`) bit for bit as its learner published it; and a worker following the chain
across the restart (the worker's own read, `bridge.weights.delta.read_for_engine`) ends on
version 5's exact bytes, whether it served 1, 2 or the killed run's 3 (a version number the
rerun republished with other weights: the patches on it do not verify, the worker takes the
anchor).

Would catch (each tried): a restarted publisher that diffs against anything it did not
publish itself (3 would be a delta), a store that keeps the killed run's versions past the
checkpoint (the rerun's 3 is never written), a worker that trusts its copy of a
republished number (no retry from the anchor).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import numpy as np

from tests import xla_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
HOLDING = "HOLDING AFTER VERSION"
RL_STEPS = 5


def sha(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


# -- the child: the learner that is killed ---------------------------------------------------
def _config():
    from learner_jax import config_file

    c = config_file.load_config(os.path.join(ROOT, "configs", "test_tiny.py"))
    c.sft.steps, c.total_steps = 0, RL_STEPS
    c.checkpoint.interval, c.checkpoint.async_save = 2, False
    c.model.param_dtype = "bfloat16"  # some stored elements change per step
    c.bridge.publish_dtype = "bfloat16"  # the masters' own dtype: published as they are
    c.optimizer.learning_rate, c.optimizer.warmup_steps = 3e-5, 0
    c.optimizer.end_lr_fraction = 1.0  # every step at this rate
    c.bridge.delta.enabled, c.bridge.delta.anchor_every = "true", 100
    return c


def _batches(learner, seed: int):
    """Random RL batches for the steps after the restored one (seeded per run and step)."""
    from learner_jax.training import train_step

    c, vocab = learner.config, learner.model_cfg.vocab_size
    rows = c.batch.groups_per_step * c.batch.samples_per_group
    length = c.batch.max_prompt_len + c.batch.max_answer_len
    while True:
        rng = np.random.default_rng([seed, learner.step])
        tokens = rng.integers(3, vocab, (rows, length + 1))
        mask = np.zeros_like(tokens)
        mask[:, c.batch.max_prompt_len :] = 1
        batch = train_step.make_batch(
            tokens, mask, behavior_logp=np.full((rows, length), -4.0),
            advantages=rng.standard_normal(rows), on_policy=np.ones(rows),
        )  # fmt: skip
        yield batch, {"policy_version": learner.step}, {"step": learner.step}


class _PublishAndRecord:
    """The binary's publish hook (`WeightPublisher.after_step`), then a record of what the
    learner published; holds (for the SIGKILL) after version `hold_at`."""

    def __init__(self, publisher, record_path: str, hold_at: int):
        self.publisher, self.record_path, self.hold_at = publisher, record_path, hold_at

    def record(self, learner) -> None:
        from bridge.weights.delta_publisher import whole
        from learner_jax import publish

        dtype = str(learner.publish_dtype)
        sources = publish.hf_sources(learner.model_cfg, learner.policy_params)
        row = {"version": learner.step, "sha": {n: sha(whole(n, s, dtype)) for n, s in sources}}
        with open(self.record_path, "a") as f:
            f.write(json.dumps(row) + "\n")

    def after_step(self, learner, metrics):
        out = self.publisher.after_step(learner.rl_steps)
        self.record(learner)
        print(f"published {learner.step}", flush=True)
        if learner.step == self.hold_at:
            print(HOLDING, learner.step, flush=True)
            while True:  # the test SIGKILLs the process here
                time.sleep(3600)
        return out


def child(workdir: str, record_path: str, seed: int, hold_at: int) -> None:
    from bridge.contracts.prompt import TextCodec
    from learner_jax import train
    from learner_jax.learner import Learner
    from learner_jax.rl import weights

    config = _config()
    learner = Learner(config, workdir)
    codec = TextCodec(learner.hf_dir)
    store = weights.open_store(config.bridge.store, workdir, learner.step)
    publisher = weights.WeightPublisher(
        store, lambda version, spec: version, learner, every=1, keep=100, background=False,
        seed=config.seed, vocab_size=codec.tok.get_vocab_size(), bos_id=codec.bos_id,
        delta_config=config.bridge.delta,
    )  # fmt: skip
    hook = _PublishAndRecord(publisher, record_path, hold_at)
    publisher.publish(learner.step)  # synchronous, as the binary's first version
    hook.record(learner)
    train.run_rl(learner, _batches(learner, seed), [hook])
    learner.close()
    print("finished", learner.step, flush=True)


# -- the test ---------------------------------------------------------------------------------
def _run_child(workdir, record, seed, hold_at=-1, timeout_s=600.0) -> list[str]:
    """Run the child; with `hold_at`, SIGKILL it once it holds after that version."""
    env = xla_env.child_env(devices=8)
    env.update(
        JAX_PLATFORMS="cpu",
        PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
    )
    args = [sys.executable, os.path.abspath(__file__), workdir, record, str(seed), str(hold_at)]
    proc = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    out: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [out.put(s) for s in proc.stdout], daemon=True).start()
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s  # a hang guard: the child needs ~15 s of CPU
    try:
        while not any(HOLDING in s or s.startswith("finished") for s in lines):
            if proc.poll() is not None and out.empty():
                break
            try:
                lines.append(out.get(timeout=max(0.0, min(1.0, deadline - time.monotonic()))))
            except queue.Empty:
                assert time.monotonic() < deadline, "the child hangs:\n" + "".join(lines[-40:])
        if hold_at >= 0:
            assert any(HOLDING in s for s in lines), "".join(lines[-40:])
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=60) == -signal.SIGKILL, "".join(lines[-40:])
        else:
            assert proc.wait(timeout=max(1.0, deadline - time.monotonic())) == 0, "".join(
                lines[-40:]
            )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return lines


def _records(path: str) -> dict[int, dict[str, str]]:
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    return {r["version"]: r["sha"] for r in rows}


def test_sigkill_mid_delta_chain_restarts_with_a_fresh_anchor(tmp_path):
    from bridge.store.manifest import CorruptVersionError
    from bridge.store.weight_store import WeightStore
    from bridge.weights.delta import read_for_engine
    from bridge.weights.delta_reconstruct import reconstruct
    from learner_jax.rl.weights import own_store

    workdir = str(tmp_path / "run")
    first, second = str(tmp_path / "first.jsonl"), str(tmp_path / "second.jsonl")
    _run_child(workdir, first, seed=1, hold_at=3)
    store = WeightStore(own_store(workdir))
    assert store.versions() == list(range(4))
    assert store.manifest(0).delta is None  # nothing to diff against: full
    for v in range(1, 4):  # a chain of real patches on the previous version
        d = store.manifest(v).delta
        assert d is not None and d.base == v - 1 and not store.manifest(v).is_full, v
        assert any(t.kind == "patch" for t in d.tensors.values()), v
    held = {v: store.read_all(v) for v in (1, 2, 3)}  # what workers hold when it dies
    ckpts = sorted(int(d) for d in os.listdir(os.path.join(workdir, "checkpoints")) if d.isdigit())
    assert ckpts[-1] == 2, ckpts  # 3 was published but never checkpointed

    _run_child(workdir, second, seed=2)
    want = {**_records(first), **_records(second)}  # the rerun's 3.. replace the first's
    assert _records(second)[2] == _records(first)[2]  # restored bit for bit, not republished
    assert _records(second)[3] != _records(first)[3]  # the rerun's 3 is other weights
    store = WeightStore(own_store(workdir))
    assert store.versions() == list(range(RL_STEPS + 1))
    m3 = store.manifest(3)
    assert m3.is_full and m3.delta is None  # the fresh anchor: no patch on a base it never held
    for v in (4, 5):
        d = store.manifest(v).delta
        assert d is not None and d.base == v - 1 and d.anchor == 3 and not store.manifest(v).is_full
    for v in range(RL_STEPS + 1):  # every version, both runs: bit for bit as published
        got = store.read_all(v)
        assert {n: sha(a) for n, a in got.items()} == want[v], v

    # Workers following the chain across the restart.
    with_patches = reconstruct(store, 5, have=(3, store.read_all(3)))
    assert with_patches.path == [4, 5]  # the rerun's 3 in hand: its patches
    try:
        reconstruct(store, 5, have=(3, held[3]))
        raise AssertionError("patches of the rerun applied to the killed run's 3 were accepted")
    except CorruptVersionError:
        pass  # the killed run's 3 is another tensor under the same number: refused
    for served in (1, 2, 3):
        have = (served, held[served])
        for v in range(served + 1, RL_STEPS + 1):  # one version at a time, as announced
            tensors, _ = read_for_engine(store, v, have)
            assert {n: sha(a) for n, a in tensors.items()} == want[v], (served, v)
            have = (v, tensors)
        # or straight to the newest
        tensors, _ = read_for_engine(store, 5, (served, held[served]))
        assert {n: sha(a) for n, a in tensors.items()} == want[5], served


if __name__ == "__main__":
    child(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
