"""Hostile workers against the exact check, through HTTP, in the real training binary.

`python -m learner_jax.train` (configs/test_tiny.py, two local vLLM workers, fp32) trains a
tiny model with peaked weights (std 0.2: choosing tokens shows within a few samples) while
five hostile threads (bench/chaos_hostile.py) sample honestly with each lease's seed but
for one cheat: `writer` (one sample per group is the right answer plus an advertisement),
`cool` (T=0.9 while the lease says 1.0), `reregister` (the right answer alone in one
sample per group, a new worker id after every lease, one credential), `bestof` (one sample
per group is the likeliest of four draws) and `evalfab` (evaluation work only: the right
answer in every greedy fleet-evaluation group, evaluated every 4 steps).

Each thread knows how many of its tokens are not the seeded sampler's choice (fp32 on both
sides: exactly what the learner finds). From the learner's per-step record in train.log
(`exact check step N: groups {...} refused [...]`, learner_jax/rl/batches.py) the test
replays the quarantine rule (bridge/contracts/exact_check.py `quarantines`: 8 mismatches
that are >= 1% of the identity's checked tokens, summed over all its groups the learner
checked) and asserts:

- every group with a chosen token was refused: none trained;
- each hostile identity was quarantined (reregister: its credential barred, 403) by the
  learner's audit, and no group of it was consumed after that step: at most the groups that
  reach 8 mismatches plus the rest of that one batch;
- reregister needed several worker ids (its groups carry few tokens): the count is summed
  per credential;
- the honest workers had 0 refused groups and 0 quarantines;
- no evaluation answer that is not the greedy argmax counted (eval_samples.jsonl), and the
  evaluation fabricator was quarantined for it.

    pytest -m "slow and vllm" tests/bench/exact_hostile_test.py
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from safetensors.numpy import save_file

from bench import chaos_hostile
from bench.chaos_soak import free_port
from bench.exact_log import learner_record
from bridge.contracts import exact_check
from bridge.model import tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GROUPS_PER_STEP, MAX_TOKENS = 2, 8
ARGS = [
    "--config.local_workers=2",
    "--config.sft.steps=0",
    "--config.total_steps=2000",  # stopped with SIGINT once every hostile worker is out
    f"--config.batch.groups_per_step={GROUPS_PER_STEP}",
    f"--config.batch.max_answer_len={MAX_TOKENS}",
    "--config.batch.max_prompt_len=16",
    "--config.eval.on=fleet",
    # An evaluation every 4 steps, 2 greedy samples per prompt: often enough that the
    # fabricator gets eval leases, rarely enough that the hostile threads (transformers,
    # one token at a time) still get rollout leases.
    "--config.rollout.eval_period=4",
    "--config.eval.n=2",
    "--config.task.eval_size=4",
    "--config.fleet.max_num_seqs=16",
    "--config.checkpoint.interval=1000",
    # reregister takes a new worker id after every lease; the per-identity registration
    # burst (bridge/control/trust/limits.py) would pace it to one per 20 s, which is not what
    # this test measures (tests/bridge/control/trust/registration_test.py does)
    "--config.controller.register_identity_burst=1000",
]


def peaked_workdir(workdir):
    """<workdir>/model as the binary would write it for test_tiny, with peaked weights."""
    path = os.path.join(workdir, "model")
    cfg = tiny_model.tiny_config("qwen3")  # test_tiny's 2 x 64 x 128 shape
    tiny_model.make_tiny_model(path, cfg)
    weights = tiny_model.random_hf_weights(cfg, seed=3, std=0.2)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


def test_hostile_workers_are_caught_and_nothing_they_chose_trains(tmp_path):
    workdir = str(tmp_path / "run")
    peaked_workdir(workdir)
    port = free_port()
    cmd = [sys.executable, "-m", "learner_jax.train", "--config=configs/test_tiny.py",
           f"--workdir={workdir}", f"--config.controller.port={port}", *ARGS]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)
    log = open(tmp_path / "binary.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    workers = []
    try:
        token = os.path.join(workdir, "join_token")
        deadline = time.monotonic() + 600  # a liveness bound, not a timing
        while not os.path.exists(token):
            assert proc.poll() is None and time.monotonic() < deadline, "binary never served"
            time.sleep(0.5)
        time.sleep(0.5)  # written whole before the service starts; read it once complete
        with open(token) as f:
            secret = f.read().strip()
        workers = chaos_hostile.start(f"http://127.0.0.1:{port}", secret, workdir,
                                      chaos_hostile.SEEDED, seed=11)  # fmt: skip
        while not all(w._done() for w in workers):
            assert proc.poll() is None, f"binary exited {proc.returncode}"
            assert time.monotonic() < deadline, [w.result for w in workers]
            time.sleep(1.0)
        # A few more steps: the honest workers' groups after every hostile one is out; and
        # one fleet evaluation finished (on a busy box the hostile threads can be done before
        # the first one is).
        last = learner_record(workdir)[0][-1][0]
        samples = os.path.join(workdir, "eval_samples.jsonl")
        while learner_record(workdir)[0][-1][0] < last + 3 or not (
            os.path.exists(samples) and os.path.getsize(samples) > 0
        ):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(1.0)
    finally:
        results = {w.kind: w.stop() for w in workers}
        with open(tmp_path / "hostile.json", "w") as f:  # what each thread did, for a failure
            json.dump(results, f, indent=1)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
        log.close()
    consumed, quarantined = learner_record(workdir)
    hostile_ids = {i for r in results.values() for i in r["worker_ids"]}
    # The learner found mismatches exactly in the steps where the hostile threads know they
    # made some (honest groups: none). (The counts agree to a token or so: one run found 47
    # where the threads counted 46, not yet explained.)
    made = {(g["worker_id"], g["group_id"]): g["mismatches"] for r in results.values()
            for g in r["groups"] if not g.get("eval")}  # fmt: skip
    expect: dict[int, int] = {}
    for step, gid, w, _ in consumed:
        expect[step] = expect.get(step, 0) + made.get((w, gid), 0)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f]
    # A metrics row's step counts the updates done: batch `step` trains into row step + 1.
    found = {r["step"] - 1: r["exact/mismatched_tokens"] for r in rows if r.get("phase") == "rl"}
    both = sorted(found.keys() & expect.keys())
    assert [found[s] > 0 for s in both] == [expect[s] > 0 for s in both], (found, expect)
    assert len(found.keys() & expect.keys()) >= len(expect) - 1  # the SIGINT's last step
    assert all(r.get("exact/flipped_tokens", 0) == 0 for r in rows), "fp32 near-ties"
    report = {}
    for kind, r in results.items():
        groups = {g["group_id"]: g for g in r["groups"] if not g.get("eval")}
        ids = set(r["worker_ids"])
        mine = [(s, gid, refused) for s, gid, w, refused in consumed if w in ids]
        # Not one group with a chosen token trained.
        trained = [gid for _, gid, refused in mine if not refused]
        assert all(groups[gid]["mismatches"] == 0 for gid in trained), (kind, trained, groups)
        # Quarantined by the learner's audit, and nothing of it consumed after that step:
        # every group of it that reached a batch counted, at least 1 mismatch each, so at
        # most 8 (the rule's count) plus the rest of the last batch.
        at = min((quarantined[i] for i in ids if i in quarantined), default=None)
        assert at is not None, (kind, ids, quarantined)
        assert max((s for s, _, _ in mine), default=at) <= at, (kind, at, mine)
        if kind != "evalfab":  # it takes no rollout work: its evaluations count against it
            bound = exact_check.QUARANTINE_TOKENS + GROUPS_PER_STEP - 1
            assert len(mine) <= bound, (kind, mine)
        bad = sum(groups[gid]["mismatches"] for _, gid, _ in mine)
        checked = sum(groups[gid]["tokens"] for _, gid, _ in mine)
        report[kind] = dict(ids=len(ids), accepted=len(groups), consumed=len(mine),
                            refused=len(mine) - len(trained), trained_unchanged=len(trained),
                            mismatches=bad, checked=checked)  # fmt: skip
    for kind in ("writer", "cool", "bestof", "evalfab"):
        assert results[kind]["quarantined"], (kind, results[kind])
    # Not one fabricated evaluation answer counted; the fabricator did answer some.
    fabricated = {g["prompt_id"] for g in results["evalfab"]["groups"]
                  if g.get("eval") and g["mismatches"]}  # fmt: skip
    assert fabricated, results["evalfab"]["groups"]
    fab_ids = set(results["evalfab"]["worker_ids"])
    with open(os.path.join(workdir, "eval_samples.jsonl")) as f:
        counted = [json.loads(x) for x in f]
    assert counted, "no evaluation finished"
    assert not [c for c in counted if c["worker"] in fab_ids and c["prompt_id"] in fabricated]
    assert results["reregister"]["barred"], results["reregister"]
    # One lease (one group) per worker id, a few written tokens each: no id of reregister
    # could reach 8 mismatches alone; the count per credential did.
    rereg = results["reregister"]["groups"]
    assert max(g["mismatches"] for g in rereg) < exact_check.QUARANTINE_TOKENS, rereg
    assert report["reregister"]["ids"] >= 2, report
    honest = [(gid, refused) for _, gid, w, refused in consumed if w not in hostile_ids]
    assert honest, "the honest workers trained nothing"
    assert not any(refused for _, refused in honest), honest
    assert set(quarantined) <= hostile_ids, set(quarantined) - hostile_ids
    report["honest"] = dict(consumed=len(honest), refused=0, steps=consumed[-1][0])
    print(json.dumps(report))
