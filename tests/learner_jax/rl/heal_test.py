"""The run heals a version the workers cannot load: a corrupt head version, a resume onto one.

Real parts, in-process, as the training binary wires them (learner_jax/train.py): the
`Learner` on configs/test_tiny.py (S = 2, kappa = 1, synchronous publishing), the
controller served over HTTP, the workdir's file weight store with the binary's
`WeightPublisher`, the `BatchSource` whose wait runs the `VersionHealer`, and a real
`RolloutWorker` on the session's vLLM engine (relay off: it reads the store). The first RL
steps train on generated batches (no fleet yet); the worker joins when the head versions
are already corrupt, so none could have loaded them first.

(a) Versions 1 and 2 are corrupted in the store (bytes flipped in a chunk, as the chaos
soak's fault does: bench/chaos_faults.py) right after they are written, before they are
announced. The worker cannot load version 2 and, with nothing loaded, has no version to
generate on; the learner cannot publish without a batch. The run must re-publish 2 and
train 2 more steps past it on the worker's groups.
(b) A run checkpoints step 1 and stops; version 1 is corrupted in the store; the resumed run
must find it corrupt before announcing it, write it again and train on.

Fails (each tried): on the code before healing, both (a: no batch for step 2, TimeoutError;
b: the announced copy of 1 does not verify); with a worker's heartbeat that does not report
the version it cannot load (a: nobody asks the learner to heal, TimeoutError). The worker's
retry of a re-announced version is tests/rollout_gpu/versions_test.py's.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import threading

import numpy as np
import pytest

from bench.chaos_faults import corrupt_version

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
WAIT_S = 60.0  # the BatchSource's no-batch timeout: a stalled run fails the test


def _config(total_steps: int):
    from learner_jax import config_file

    c = config_file.load_config(os.path.join(ROOT, "configs", "test_tiny.py"))
    c.sft.steps, c.total_steps = 0, total_steps
    c.staleness, c.publish_every = 2, 1
    c.bridge.async_publish = False  # the publish hook writes, the test corrupts, then announces
    c.bridge.broadcast = "store"
    c.rollout.eval_period = 0
    c.rollout.wait_timeout_s = WAIT_S
    c.checkpoint.interval, c.checkpoint.async_save = 1, False
    return c


def _generated_batches(learner):
    """RL batches made up from the learner's step (before the fleet joins)."""
    from learner_jax.training import train_step

    c, vocab = learner.config, learner.model_cfg.vocab_size
    rows = c.batch.groups_per_step * c.batch.samples_per_group
    length = c.batch.max_prompt_len + c.batch.max_answer_len
    while True:
        rng = np.random.default_rng(learner.step)
        tokens = rng.integers(3, vocab, (rows, length + 1))
        mask = np.zeros_like(tokens)
        mask[:, c.batch.max_prompt_len :] = 1
        batch = train_step.make_batch(
            tokens, mask, behavior_logp=np.full((rows, length), -4.0),
            advantages=rng.standard_normal(rows), on_policy=np.ones(rows),
        )  # fmt: skip
        yield batch, {}, {}


class Run:
    """One run of the binary's RL parts on `workdir`; `corrupt`: versions whose first copy
    is corrupted in the store between its write and its announcement."""

    def __init__(self, workdir: str, total_steps: int, corrupt=()):
        from bridge.contracts.prompt import TextCodec
        from learner_jax import run_config, train
        from learner_jax.learner import Learner
        from learner_jax.rl import batches, heal, serve, weights

        self.workdir, self.corrupt, self.corrupted = workdir, set(corrupt), []
        config = self.config = _config(total_steps)
        self.learner = learner = Learner(config, workdir)
        task = train.make_task(config)
        codec = TextCodec(learner.hf_dir, run_config.prompt_format(config, task))
        cfg = run_config.controller_config(config, learner.model_cfg.vocab_size, codec.eos_id)
        cfg = dataclasses.replace(cfg, heartbeat_interval_s=0.5)  # a fresh worker's report
        # The first steps train on generated batches: the controller starts at the learner's
        # step with nothing consumed (no controller cursor to restore).
        self.ctl, self.server, self.closers = serve.start_controller(
            cfg,
            (workdir, task, codec),
            (None, learner.step),
            (run_config.server_options(config), None),
        )
        self.store = weights.open_store("", workdir, learner.step)
        self.publisher = weights.WeightPublisher(
            self.store, self._announce, learner, every=1, keep=config.staleness + 2,
            background=False, seed=config.seed, vocab_size=codec.tok.get_vocab_size(),
            bos_id=codec.bos_id,
        )  # fmt: skip
        self.healer = heal.VersionHealer(self.ctl, self.publisher)
        self.source = batches.BatchSource(
            self.ctl, run_config.batch_shape(config), run_config.advantage_config(config),
            codec.pad_id, lambda: learner.step, timeout_s=WAIT_S, check_fleet=self.healer.check,
        )  # fmt: skip
        self.worker = self.thread = None

    def _announce(self, version: int, spec):
        if version in self.corrupt:  # its first copy only: the learner's next one is sound
            self.corrupt.discard(version)
            self.corrupted.append(corrupt_version(self.store.spec["path"], version))
        return self.ctl.publish(version, spec)

    def start_worker(self, engine) -> None:
        from bridge.control.http.service import load_or_create_join_secret
        from bridge.control.protocol import WorkerProfile
        from rollout_gpu.worker import RolloutWorker, WorkerOptions

        opts = WorkerOptions(
            relay=False,
            controller=self.server.url,
            join_secret=load_or_create_join_secret(self.workdir),
            profile=WorkerProfile(
                accelerator="cpu", price_per_hour=0.0, max_concurrent_sequences=8
            ),
        )
        self.worker = RolloutWorker(opts, engine=engine)
        self.thread = threading.Thread(target=self.worker.run, daemon=True, name="worker")
        self.thread.start()

    def train(self, generated: int, engine=None) -> None:
        """`generated` steps on made-up batches, then (with `engine`) a worker joins and the
        fleet's batches go to the end."""
        from learner_jax import train
        from learner_jax.rl import hooks

        def fleet():
            self.start_worker(engine)
            yield from self.source

        made_up = itertools.islice(_generated_batches(self.learner), generated)
        items = itertools.chain(made_up, fleet() if engine is not None else ())
        train.run_rl(self.learner, items, [hooks.Publish(self.publisher, self.ctl)])

    def close(self) -> None:
        if self.worker is not None:
            self.worker.request_stop()
            self.thread.join(60)
            assert not self.thread.is_alive(), "the worker thread did not stop"
        for close in reversed(self.closers):
            close()
        self.learner.close()


@pytest.fixture(scope="module")
def engine(tiny_model_dir, extra_vllm_engine):
    """An engine of this module's own: its worker thread drives it, and a thread that
    outlived its test must not share an engine with later tests (vLLM is not
    thread-safe: a suite run hung in the next test's generate on the session engine)."""
    return extra_vllm_engine(tiny_model_dir, dtype="float32", max_model_len=256, seed=0)


def _trained_past(run: Run, end: int, version: int) -> None:
    """The run reached step `end` on the worker's groups, the worker serving a copy of
    `version` or newer (it loads only what verifies)."""
    assert run.learner.step == end
    consumed = run.ctl.stats()["groups/consumed"]
    assert consumed >= (end - version) * run.config.batch.groups_per_step, consumed
    assert run.worker.version >= version


def test_a_corrupt_head_version_is_published_again_and_the_run_trains_past_it(tmp_path, engine):
    run = Run(str(tmp_path), total_steps=4, corrupt=(1, 2))
    try:
        run.publisher.publish(run.learner.step)  # version 0, sound
        # Steps 0 and 1 publish versions 1 and 2, both corrupted; then the worker joins.
        run.train(generated=2, engine=engine)
        assert len(run.corrupted) == 2
        assert run.healer.healed[:1] == [2]  # the newest, from the learner's params
        _trained_past(run, end=4, version=2)
        assert run.ctl.stats()["fleet/no_admissible_work"] == 0
    finally:
        run.close()


def test_a_resume_onto_a_corrupt_version_publishes_it_again_and_trains_on(tmp_path, engine):
    first = Run(str(tmp_path), total_steps=1)
    try:
        first.publisher.publish(first.learner.step)
        first.train(generated=1)  # checkpoints step 1, version 1 in the store
    finally:
        first.close()
    assert first.learner.step == 1
    corrupt_version(first.store.spec["path"], 1)

    run = Run(str(tmp_path), total_steps=3)  # resumes at step 1: RL steps 1 and 2 remain
    try:
        assert run.learner.step == 1
        run.publisher.publish(run.learner.step)  # the binary's first, synchronous publish
        run.store.read_all(1)  # every chunk verifies: the announced copy is sound
        run.train(generated=0, engine=engine)
        _trained_past(run, end=3, version=1)
    finally:
        run.close()
