"""The learner as 2 processes x 4 CPU devices (gloo collectives on loopback), one mesh
(data=2, fsdp=2, tensor=2) spanning both, against 1 process x 8 devices on the same batches.

The batches are real trajectories: the session's vLLM engine samples completions of the
arithmetic task's prompts from the tiny model, the task scores them, and the learner's own
`rollout_batch.groups_to_batch` turns them into GRPO batches. Each learner process runs
tests/learner_jax/multihost/multihost_run.py (the binary's `train.run`, then its weight publisher).

One sequence covers the three must-shows, since every run costs ~40 s of compile:
  1. the 2-process run is stalled on process 1 after 2 steps (process 0 blocks inside the
     third step's collectives) and process 1 is SIGKILLed: process 0 must exit non-zero
     within 60 s, saying a peer stopped sending heartbeats;
  2. both are restarted on the same workdir: they resume from the step-2 checkpoint and
     finish, so losses and final params compared with the uninterrupted 8-device run show
     both "2 processes == 1 process" and "kill + resume == uninterrupted" (<= 1e-5);
  3. the version they published reads back equal to the reference's, each process wrote
     only chunks inside its own devices' shards (part files in the store), the parts are
     disjoint and cover every chunk, and the vLLM engine swaps it in with its canary (the
     learner-side log-probs computed on the sharded params) passing.
"""

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from bridge.control.protocol import ConsumedGroup, Trajectory
from bridge.store.chunk_digest import chunk_boxes
from bridge.store.layout import LAYOUT
from bridge.store.weight_store import WeightStore
from tests import xla_env

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
RUN = os.path.join(ROOT, "tests", "learner_jax", "multihost", "multihost_run.py")
STEPS, GROUPS, N, PROMPT_LEN, ANSWER_LEN = 4, 2, 4, 16, 4  # 8 rows per step (test_tiny)


@pytest.fixture(scope="module")
def batches_file(vllm_engine, tiny_model_dir, tmp_path_factory):
    """STEPS GRPO batches of real trajectories sampled by vLLM, saved as one npz."""
    from bridge.contracts.prompt import TextCodec
    from bridge.tasks import make_task
    from bridge.tasks.base import score
    from learner_jax.training import advantages, rollout_batch
    from rollout_gpu.engine import SampleRequest

    task, codec = make_task("arithmetic"), TextCodec(tiny_model_dir)
    prompts = list(itertools.islice(task.train_prompts(0), STEPS * GROUPS))
    requests = [
        SampleRequest(codec.encode_prompt(p.text), n=N, max_tokens=ANSWER_LEN, seed=i)
        for i, p in enumerate(prompts)
    ]
    groups = []
    for g, (prompt, req, samples) in enumerate(
        zip(prompts, requests, vllm_engine.generate(requests), strict=True)
    ):
        trajs = [
            Trajectory(
                prompt_id=prompt.prompt_id,
                sample_index=s.index,
                prompt_token_ids=list(req.prompt_token_ids),
                completion_token_ids=s.token_ids,
                logprobs=s.logprobs,
                versions=[0] * len(s.token_ids),
                reward=_reward(score(task, prompt, codec.decode(s.token_ids)), s.token_ids),
                finish_reason=s.finish_reason,
            )
            for s in samples
        ]
        groups.append(
            ConsumedGroup(
                group_id=g,
                prompt_id=prompt.prompt_id,
                prompt=prompt.text,
                answer=prompt.answer,
                trajectories=trajs,
            )
        )
    out = {}
    for i in range(STEPS):
        batch, _ = rollout_batch.groups_to_batch(
            groups[i * GROUPS : (i + 1) * GROUPS],
            N,
            PROMPT_LEN,
            ANSWER_LEN,
            0,
            advantages.AdvantageConfig(),
            codec.pad_id,
        )
        for name, value in vars(batch).items():
            if value is not None:  # unset optional fields (`pack`) stay unset
                out[f"{i}/{name}"] = np.asarray(value)
    assert any(out[f"{i}/advantages"].any() for i in range(STEPS)), "no learning signal"
    path = str(tmp_path_factory.mktemp("multihost") / "batches.npz")
    np.savez(path, **out)
    return path


def _reward(task_score: float, token_ids) -> float:
    """The task's score plus a dense shaping term (share of distinct tokens): the untrained
    tiny model never answers right, and all-zero rewards would leave GRPO nothing to learn."""
    return task_score + len(set(token_ids)) / max(len(token_ids), 1)


# A lost peer is detected by the coordination service's heartbeat timeout (multihost_run.py
# sets 5 s); a process still alive after 18 of them hangs, the failure these tests catch.
HEARTBEAT_S = 5
HANG_S = 18 * HEARTBEAT_S


@pytest.fixture
def coordinator_port():
    """A loopback port reserved for the coordinator until the test is done with it.

    The socket is bound (port 0, the kernel's choice) but never listens, with SO_REUSEPORT:
    the coordinator's gRPC server, which binds with SO_REUSEPORT too, can take the same port,
    while no other process can bind it or be handed it as an ephemeral port meanwhile (a
    bind-close-reuse free port races every other test on the machine).
    """
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


def _launch(workdir, out, hf_dir, batches, devices, extra=(), log=None, **flags):
    env = xla_env.child_env(devices=devices)
    env.update(
        JAX_PLATFORMS="cpu",
        PYTHONPATH=ROOT,
        PYTHONUNBUFFERED="1",
    )
    cmd = [sys.executable, RUN, f"--workdir={workdir}", f"--out={out}", f"--hf_dir={hf_dir}"]
    cmd += [f"--batches={batches}", f"--steps={STEPS}", *extra]
    cmd += [f"--{k}={v}" for k, v in flags.items()]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _launch_pair(tmp, tag, hf_dir, batches, port, pause=None):
    procs, logs = [], []
    for pid in (0, 1):
        logs.append(str(tmp / f"{tag}.{pid}.log"))
        extra = [f"--pause_before={pause}"] if pause is not None and pid == 1 else []
        procs.append(
            _launch(
                tmp / "multi",
                tmp / "multi_out",
                hf_dir,
                batches,
                4,
                extra,
                open(logs[-1], "w"),
                num_processes=2,
                process_id=pid,
                port=port,
            )
        )
    return procs, logs


def _wait_ok(proc, log, timeout=300):
    rc = proc.wait(timeout=timeout)
    assert rc == 0, open(log).read()[-4000:]


def _losses(workdir):
    lines = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    return lines, {r["step"]: r["loss"] for r in lines}


@pytest.mark.vllm
def test_two_processes_equal_one_and_survive_a_kill(
    batches_file, tiny_model_dir, vllm_engine, tmp_path, coordinator_port
):
    from rollout_gpu import weight_swap

    # Reference: one process with 8 devices, uninterrupted.
    ref_log = str(tmp_path / "ref.log")
    ref = _launch(
        tmp_path / "ref",
        tmp_path / "ref_out",
        tiny_model_dir,
        batches_file,
        8,
        (),
        open(ref_log, "w"),
    )
    _wait_ok(ref, ref_log)

    # 1. Process 1 stalls before batch 2 (steps 1-2 done and checkpointed); kill it.
    procs, logs = _launch_pair(
        tmp_path, "killed", tiny_model_dir, batches_file, coordinator_port, pause=2
    )
    # Polled state, not a sleep: process 1 is stalled before batch 2 and process 0 has
    # taken batch 2, so it is entering step 3, whose collectives wait on process 1.
    deadline = time.monotonic() + 300
    while not (
        "pausing before batch 2" in open(logs[1]).read()
        and "taking batch 2" in open(logs[0]).read()
    ):
        assert time.monotonic() < deadline and procs[0].poll() is None, open(logs[0]).read()
        time.sleep(0.5)
    procs[1].send_signal(signal.SIGKILL)
    killed = time.monotonic()
    # Detection is the heartbeat timeout's job: the survivor must exit (not hang), and say
    # why; the time is printed, bounded only by a generous multiple of that timeout.
    rc = procs[0].wait(timeout=HANG_S)
    took = time.monotonic() - killed
    text = open(logs[0]).read()
    print(f"survivor exited {rc} after {took:.1f} s (heartbeat timeout {HEARTBEAT_S} s)")
    assert rc != 0, (rc, took, text[-3000:])
    assert re.search(r"stopped sending heartbeats|heartbeat timeout", text), text[-3000:]

    # 2. Restart both on the same workdir: they resume from step 2 and finish.
    procs, logs = _launch_pair(tmp_path, "resumed", tiny_model_dir, batches_file, coordinator_port)
    for proc, log in zip(procs, logs, strict=True):
        _wait_ok(proc, log)

    ref_lines, ref_loss = _losses(tmp_path / "ref")
    lines, loss = _losses(tmp_path / "multi")
    # Only process 0 writes metrics: one line per step (2 before the kill, 2 after).
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    assert sorted(loss) == sorted(ref_loss) == [1, 2, 3, 4]
    np.testing.assert_allclose([loss[s] for s in loss], [ref_loss[s] for s in loss], atol=1e-5)
    a, b = np.load(f"{tmp_path}/multi_out.params.npz"), np.load(f"{tmp_path}/ref_out.params.npz")
    assert sorted(a.files) == sorted(b.files)
    for k in a.files:
        np.testing.assert_allclose(a[k], b[k], atol=1e-5, err_msg=k)
    loss_diff = max(abs(loss[s] - ref_loss[s]) for s in loss)
    param_diff = max(float(np.abs(a[k] - b[k]).max()) for k in a.files)
    print(
        f"2x4 (killed + resumed) vs 1x8: max|loss diff|={loss_diff:.3g}, "
        f"max|param diff|={param_diff:.3g}"
    )

    # 3. The published version: same bytes as the reference's, each chunk written once, by
    # a process that holds it.
    store, ref_store = (
        WeightStore(str(tmp_path / "multi" / "weights")),
        WeightStore(str(tmp_path / "ref" / "weights")),
    )
    assert store.latest() == ref_store.latest() == STEPS
    got, want = store.read_all(STEPS), ref_store.read_all(STEPS)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], atol=1e-5, err_msg=name)
    manifest = store.manifest(STEPS)
    parts = {}
    for pid in (0, 1):
        key = LAYOUT.part_key(STEPS, pid)
        parts[pid] = json.loads(store.kv.read(key).result().value)["arrays"]
    local = {p: json.load(open(f"{tmp_path}/multi_out.{p}.json"))["local"] for p in (0, 1)}
    for name, info in manifest.arrays.items():
        written = {p: {tuple(c[:-1]) for c in parts[p][name]["digests"]} for p in (0, 1)}
        assert not written[0] & written[1], name
        assert written[0] | written[1] == {pos for pos, _ in chunk_boxes(info.shape, info.chunks)}
        for p in (0, 1):
            assert written[p] <= {tuple(c) for c in local[p][name]}, (name, p)
    assert all(sum(len(parts[p][n]["digests"]) for n in parts[p]) > 0 for p in (0, 1))

    # The worker side: the vLLM engine swaps the version in; its canary must pass.
    current = weight_swap.EngineVersion()
    try:
        result = weight_swap.load_version(vllm_engine, store, STEPS, current, require_canary=True)
        print(f"swap of the 2-process version: {result.detail}")
        assert result.ok and current.version == STEPS
    finally:
        weight_swap.restore(vllm_engine, weight_swap.EngineVersion())


BINARY_ARGS = [
    "--config=configs/tiny_arith.py",
    "--config.total_steps=3",
    "--config.sft.steps=2",
    "--config.sft.batch_size=8",
    "--config.sft.micro_batch_size=8",
    "--config.sft.warmup_steps=0",
    "--config.batch.groups_per_step=4",
    "--config.batch.samples_per_group=4",
    "--config.batch.micro_batch_size=8",
    "--config.model.tiny_num_layers=2",
    "--config.model.tiny_hidden_size=64",
    "--config.model.tiny_intermediate_size=128",
    "--config.local_workers=1",
    "--config.rollout.eval_period=2",
    "--config.checkpoint.interval=2",
    "--config.mesh.data=2",
    "--config.mesh.fsdp=2",
    "--config.mesh.tensor=2",
    "--config.distributed.num_processes=2",
]


@pytest.mark.vllm
def test_binary_runs_as_two_processes_with_a_vllm_worker(tmp_path, coordinator_port):
    """`python -m learner_jax.train` x 2: SFT, then RL fed by a real vLLM worker that joins
    process 0's controller and swaps in every version the two processes publish."""
    workdir, port, procs, logs = tmp_path / "run", coordinator_port, [], []
    env = xla_env.child_env(devices=4)
    env.update(
        JAX_PLATFORMS="cpu",
        PYTHONPATH=ROOT,
        PYTHONUNBUFFERED="1",
    )
    for pid in (0, 1):
        logs.append(tmp_path / f"p{pid}.log")
        cmd = [sys.executable, "-m", "learner_jax.train", f"--workdir={workdir}", *BINARY_ARGS]
        cmd += [
            f"--config.distributed.coordinator_address=127.0.0.1:{port}",
            f"--config.distributed.process_id={pid}",
        ]
        out = open(logs[-1], "w")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT))
    try:
        for proc, log in zip(procs, logs, strict=True):
            assert proc.wait(timeout=900) == 0, log.read_text()[-4000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    lines, _ = _losses(workdir)
    assert [(r["step"], r["phase"]) for r in lines] == [
        (s, "sft" if s <= 2 else "rl") for s in range(1, 6)
    ]
    assert all(r["policy_version"] >= 2 and "mismatch/kl" in r for r in lines[2:])
    assert [json.loads(x)["tag"] for x in open(workdir / "eval.jsonl")] == ["before", "rl", "after"]
    store = WeightStore(str(workdir / "weights"))
    assert store.latest() == 5
    for version in store.versions():  # every version: both processes wrote chunks
        for pid in (0, 1):
            key = LAYOUT.part_key(version, pid)
            part = json.loads(store.kv.read(key).result().value)["arrays"]
            assert sum(len(a["digests"]) for a in part.values()) > 0, (version, pid)
    worker_log = "".join(p.read_text() for p in (workdir / "workers").glob("*.log"))
    served = {int(v) for v in re.findall(r"now serving version (\d+) \(swap", worker_log)}
    # Every version was written by both processes; the worker's swaps passed their canary.
    assert served and served <= set(range(2, 6)), worker_log[-3000:]
    assert "float32 canary" in worker_log


def test_losing_process_0_stops_the_other(tmp_path, coordinator_port):
    """The coordinator's host dies: the other process, blocked waiting on it, exits non-zero
    with JAX's message instead of hanging (the opposite case of the kill above)."""
    port, procs, logs = coordinator_port, [], []
    for pid, flag in ((0, "--die_after_init"), (1, "--block_after_init")):
        logs.append(tmp_path / f"p{pid}.log")
        procs.append(
            _launch(
                tmp_path,
                tmp_path / "out",
                "",
                "unused.npz",
                4,
                [flag],
                open(logs[-1], "w"),  # noqa: SIM115 - closed with the process
                num_processes=2,
                process_id=pid,
                port=port,
            )
        )
    assert procs[0].wait(timeout=300) == 3, logs[0].read_text()[-3000:]
    died = time.monotonic()
    rc = procs[1].wait(timeout=HANG_S)
    took, text = time.monotonic() - died, logs[1].read_text()
    print(f"process 1 exited {rc} {took:.1f} s after process 0 died")
    assert "process 1 connected" in text
    assert rc != 0, (rc, took, text[-3000:])
    assert "JAX distributed service detected fatal errors" in text, text[-3000:]
