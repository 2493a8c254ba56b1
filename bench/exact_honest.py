"""Honest workers under the exact check for a whole run: no group refused, nobody quarantined.

    python -m bench.exact_honest --out=/tmp/exact_honest.json --minutes=10

The training binary on the demo config (configs/tiny_arith.py: SFT, then RL with
`controller.exact_check` on) with one local worker (vLLM float32, the binary's own fleet)
and one worker started here with `--dtype=bfloat16`: the learner checks every sampled token
of both at float32 against the seeded sampler's choice (bridge/contracts/exact_check.py:
float32 engines get the 1e-3 margin, bf16 ones 0.02 + 0.08 max|z|). After `--minutes` of
RL the binary is stopped with SIGINT. From train.log (the learner's per-step line
`exact check step N: groups {...} refused [...]` and the controller's quarantine lines) and
metrics.jsonl (`exact/*`) it reports, per worker: groups consumed, groups refused, and
whether it was quarantined; and the run's checked, mismatched and flipped tokens.

Headline keys: `honest_refused_groups`, `honest_quarantined` (both must be 0),
`checked_tokens`, `bf16_groups`, `fp32_groups`, `flipped_tokens`, `rl_minutes`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from bench.chaos_soak import free_port
from bench.exact_log import learner_record, metrics_rows
from bridge.fleet.local import worker_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BF16_NAME = "bf16-worker"


def summarize(workdir: str, bf16_ids: set[str], minutes: float) -> dict:
    consumed, quarantined = learner_record(workdir)
    per: dict[str, dict] = {}
    for _, _, w, refused in consumed:
        row = per.setdefault(w, {"dtype": "bfloat16" if w in bf16_ids else "float32",
                                 "groups": 0, "refused": 0})  # fmt: skip
        row["groups"] += 1
        row["refused"] += int(refused)
    for w, row in per.items():
        row["quarantined"] = w in quarantined
    rl = [r for r in metrics_rows(workdir) if r.get("phase") == "rl"]
    total = lambda key: int(sum(r.get(key, 0) for r in rl))  # noqa: E731
    return {
        "honest_refused_groups": sum(r["refused"] for r in per.values()),
        "honest_quarantined": len(quarantined),
        "checked_tokens": total("exact/checked_tokens"),
        "mismatched_tokens": total("exact/mismatched_tokens"),
        "flipped_tokens": total("exact/flipped_tokens"),
        "bf16_groups": sum(r["groups"] for w, r in per.items() if w in bf16_ids),
        "fp32_groups": sum(r["groups"] for w, r in per.items() if w not in bf16_ids),
        "rl_steps": len(rl),
        "rl_minutes": round(minutes, 2),
        "workers": per,
    }


def bf16_worker_ids(workdir: str) -> set[str]:
    """Ids the bench's bf16 worker registered under (its log names them)."""
    ids, pat = set(), re.compile(r"joined \S+ as (\S+) \(heartbeat")
    path = os.path.join(workdir, "workers", f"{BF16_NAME}.log")
    if os.path.exists(path):
        with open(path, errors="replace") as f:
            ids |= {m[1] for line in f if (m := pat.search(line))}
    return ids


def run(workdir: str, minutes: float, extra: list[str]) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "learner_jax.train", "--config=configs/tiny_arith.py",
           f"--workdir={workdir}", f"--config.controller.port={port}",
           "--config.local_workers=1", "--config.total_steps=100000", *extra]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)
    os.makedirs(os.path.join(workdir, "workers"), exist_ok=True)
    log = open(os.path.join(workdir, "binary.log"), "w")  # noqa: SIM115
    binary = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    worker, rl_start = None, None
    try:
        token = os.path.join(workdir, "join_token")
        while not os.path.exists(token):
            if binary.poll() is not None:
                raise RuntimeError(f"the binary exited {binary.returncode} (binary.log)")
            time.sleep(0.5)
        wlog = open(os.path.join(workdir, "workers", f"{BF16_NAME}.log"), "ab")  # noqa: SIM115
        worker = subprocess.Popen(
            [sys.executable, "-m", "rollout_gpu.worker", f"--controller=http://127.0.0.1:{port}",
             f"--token_file={token}", "--dtype=bfloat16", f"--name={BF16_NAME}",
             f"--cache_dir={os.path.join(workdir, 'workers', 'bf16-cache')}",
             "--max_num_seqs=64", "--cpu_kvcache_gib=1", "--seed=77", "--norelay"],
            cwd=ROOT, env=worker_env(1), stdout=wlog, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        while True:
            if binary.poll() is not None:
                raise RuntimeError(f"the binary exited {binary.returncode} (binary.log)")
            if rl_start is None and any(r.get("phase") == "rl" for r in metrics_rows(workdir)):
                rl_start = time.monotonic()
            if rl_start is not None and time.monotonic() - rl_start >= minutes * 60:
                break
            time.sleep(2.0)
    finally:
        if binary.poll() is None:
            binary.send_signal(signal.SIGINT)
            try:
                binary.wait(timeout=180)
            except subprocess.TimeoutExpired:
                binary.kill()
        if worker is not None and worker.poll() is None:
            worker.terminate()
            try:
                worker.wait(timeout=30)
            except subprocess.TimeoutExpired:
                worker.kill()
        log.close()
    elapsed = (time.monotonic() - rl_start) / 60 if rl_start else 0.0
    return summarize(workdir, bf16_worker_ids(workdir), elapsed)


_OUT = flags.DEFINE_string("out", "", "write the JSON result here")
_MINUTES = flags.DEFINE_float("minutes", 10.0, "minutes of RL after the first RL step")
_WORKDIR = flags.DEFINE_string("workdir", "", "run directory (default: a fresh temp dir)")
_BINARY_FLAGS = flags.DEFINE_multi_string(
    "binary_flag", [], "a flag for the training binary, e.g. --binary_flag=--config.seed=3"
)


def main(argv) -> None:
    del argv
    workdir = _WORKDIR.value or tempfile.mkdtemp(prefix="echo2_exact_honest_")
    result = run(workdir, _MINUTES.value, list(_BINARY_FLAGS.value))
    print(f"workdir {workdir}")
    print(f"{'worker':<40} {'dtype':<9} {'groups':>7} {'refused':>8} {'quarantined':>12}")
    for w, r in sorted(result["workers"].items()):
        print(f"{w:<40} {r['dtype']:<9} {r['groups']:>7} {r['refused']:>8} "
              f"{str(r['quarantined']):>12}")  # fmt: skip
    for key in ("honest_refused_groups", "honest_quarantined", "checked_tokens",
                "mismatched_tokens", "flipped_tokens", "rl_steps", "rl_minutes"):  # fmt: skip
        print(f"{key:<24} {result[key]}")
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    app.run(main)
