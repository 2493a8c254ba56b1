"""Kill -9 of the learner while an asynchronous orbax save is in flight, then resume.

A child process (this file run as a script) holds a sharded train state on 8 devices,
saves step 1 and waits for it, then starts the asynchronous save of step 2. Every array of
step 2 is written, and the child is SIGKILLed by the test at the one moment left: after
`save()` returned, before the step directory is committed (orbax's rename of
`2.orbax-checkpoint-tmp`). The moment is found, not waited for: the child holds orbax's
commit of step 2 (the `finalize` of its step directory) and says so on stdout; the test
reads that line and kills it. Nothing else in the save is changed.

Then, in this process, a new `Checkpointer` on the same directory must see step 1 as the
latest, restore it bit for bit (params, Adam moments, counters, step, RNG key; every leaf
drawn at random so no leaf is trivially equal) with its cursor, ignore the partial step 2
left on disk, and let the resumed run save step 2 over it.

Would catch: a restore that picks the newest directory including uncommitted ones (a step
number parsed from `2.orbax-checkpoint-tmp`: fails here), a restore of the wrong step or a
lossy one, and a partial step that blocks the resumed run's save of the same step. Orbax's
commit-file mode (the step directory keeps its final name, committed by a marker file, as
on GCS) passes too: its step list skips a directory without the marker.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np

from bridge.model import tiny_model
from learner_jax.model import sharding
from learner_jax.training import checkpoint, optim, train_state
from tests import xla_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CFG = tiny_model.tiny_config("qwen3")
OPT = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-3, total_steps=10))
MESH = {"data": 2, "fsdp": 2, "tensor": 2}
CKPT = checkpoint.CheckpointConfig(interval=1, keep=3, async_save=True)
HELD = "HOLDING COMMIT OF STEP 2"
RETURNED = "SAVE RETURNED"


def drawn_state(mesh, seed: int):
    """A train state of the real structure and shardings, every leaf drawn at random."""
    rng = np.random.default_rng(seed)
    state = train_state.create_train_state(CFG, OPT, mesh, seed=seed)

    def draw(x):
        if is_float(x.dtype):
            host = rng.standard_normal(x.shape).astype(x.dtype)
        else:
            host = rng.integers(1, 1 << 20, x.shape).astype(x.dtype)
        return jax.device_put(host, x.sharding)

    return jax.tree.map(draw, state)


def is_float(dtype) -> bool:
    return np.issubdtype(np.dtype(dtype), np.floating)


def host_leaves(state) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state))]


# -- the child: the learner that is killed ---------------------------------------------------
def _hold_commit_of_step_2():
    """Make orbax's commit of step 2's directory announce itself and never finish."""
    import asyncio

    from orbax.checkpoint._src.path import atomicity

    for cls in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):
        original = cls.finalize

        async def finalize(self, _original=original):
            if self.get_final().name != "2":  # item directories and step 1 commit as usual
                return await _original(self)
            print(HELD, self.get(), flush=True)
            while True:  # the test SIGKILLs the process here
                await asyncio.sleep(3600)

        cls.finalize = finalize


def child(directory: str) -> None:
    mesh = sharding.make_mesh(MESH)
    ckpt = checkpoint.Checkpointer(directory, CKPT)
    one = drawn_state(mesh, seed=1)
    assert ckpt.save(1, one, {"step": 1, "prompts": 17})
    ckpt.wait_until_finished()
    np.savez(os.path.join(directory, os.pardir, "step1.npz"), *host_leaves(one))

    _hold_commit_of_step_2()
    two = drawn_state(mesh, seed=2)
    assert ckpt.save(2, two, {"step": 2, "prompts": 34})
    print(RETURNED, flush=True)  # save() returned: the write runs in orbax's background thread
    ckpt.wait_until_finished()  # never returns: the commit is held
    raise AssertionError("the commit of step 2 finished")


# -- the test ---------------------------------------------------------------------------------
def run_child_and_kill_mid_save(directory: str, timeout_s: float = 240.0) -> list[str]:
    """Start the child, SIGKILL it once step 2 is written but not committed; its lines."""
    env = xla_env.child_env(devices=8)
    env.update(
        JAX_PLATFORMS="cpu",
        PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
    )
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), directory],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [out.put(s) for s in proc.stdout], daemon=True).start()
    lines = []
    deadline = time.monotonic() + timeout_s  # a hang guard: the child needs ~10 s
    try:
        # Both lines, in either order: the background commit may start before the main
        # thread prints that save() returned.
        while not (any(HELD in s for s in lines) and any(RETURNED in s for s in lines)):
            assert proc.poll() is None, "the child exited:\n" + "".join(lines[-40:])
            try:
                lines.append(out.get(timeout=max(0.0, min(1.0, deadline - time.monotonic()))))
            except queue.Empty:
                assert time.monotonic() < deadline, "the child hangs:\n" + "".join(lines[-40:])
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL, "".join(lines[-40:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return lines


def test_kill9_mid_async_save_resumes_from_the_last_complete_step(tmp_path):
    directory = str(tmp_path / "checkpoints")
    run_child_and_kill_mid_save(directory)

    # On disk: step 1 committed, step 2 written in full but not committed (orbax's temporary
    # name on a local disk; other atomicity modes keep the final name without a commit file).
    names = sorted(os.listdir(directory))
    partial = [n for n in names if n == "2" or n.startswith("2.")]
    assert "1" in names and len(partial) == 1, names
    written = [f for _, _, fs in os.walk(os.path.join(directory, partial[0])) for f in fs]
    assert len(written) > 3, written  # the arrays were written; only the commit is missing

    mesh = sharding.make_mesh(MESH)
    abstract, _ = train_state.state_shardings(CFG, OPT, mesh)
    ckpt = checkpoint.Checkpointer(directory, CKPT)
    try:
        assert ckpt.latest_step() == 1 and ckpt.all_steps() == [1]
        state, cursor = ckpt.restore(abstract)
        assert cursor == {"step": 1, "prompts": 17}
        with np.load(str(tmp_path / "step1.npz")) as ref:
            want = [ref[f"arr_{i}"] for i in range(len(ref.files))]
        got = host_leaves(state)
        assert len(got) == len(want) > 10
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)  # bitwise: the saved bytes, not close ones

        # The resumed run reaches step 2 again: its save replaces the partial one.
        again = drawn_state(mesh, seed=3)
        assert ckpt.save(2, again, {"step": 2, "prompts": 35})
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [1, 2]
        state, cursor = ckpt.restore(abstract, step=2)
        assert cursor == {"step": 2, "prompts": 35}
        for a, b in zip(host_leaves(state), host_leaves(again), strict=True):
            np.testing.assert_array_equal(a, b)
    finally:
        ckpt.close()
    assert not [n for n in os.listdir(directory) if "tmp" in n]


if __name__ == "__main__":
    child(sys.argv[1])
