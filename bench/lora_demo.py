"""The demo task's two RL arms from ONE SFT policy, for bench.lora (`--demo_root=DIR`):

    python -m bench.lora --out=F.json --demo_root=/tmp/lora_demo [--sft_steps=2000] \
        [--rl_steps=300] [--lora_args="--config.optimizer.learning_rate=..."]

Stages, each a real training-binary (or export) process, skipped when its output is there
(so a rerun after a changed LoRA setting reuses the SFT policy; delete a dir to redo it):

  1. `DIR/sft`: configs/tiny_arith.py SFT only (`sft.steps` = the demo's 2000,
     `total_steps=0`): full weights, the demo's warm start;
  2. `DIR/sft_export`: `python -m bridge.export` of its last step (fp32, HF layout);
  3. `DIR/lora`: configs/tiny_arith_lora.py RL from that export (`model.hf_dir`,
     `sft.steps=0`);
  4. `DIR/full`: configs/tiny_arith.py RL from the same export;
  5. with `fleet_eval_steps` > 0, `DIR/lora_fleet_eval`: the LoRA arm again for that many
     steps with `eval.on=fleet`: the workers evaluate adapter versions (eval leases of
     exactly that adapter), the learner audits the eval rows under the stored adapter
     version (`fleet_eval_stats`).

Both arms: the same `total_steps` (`--rl_steps`), two local vLLM workers (the config's),
`model.dtype=float32` (with `hf_dir` set, 'auto' would mean bfloat16, and the demo's
full run computes in fp32), run one after the other so they do not share the CPUs. The
learner process's peak RSS (VmHWM, polled) is written to `<arm>/bench_rss.json`.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RSS_FILE = "bench_rss.json"
TIMEOUT_S = 3 * 3600


def peak_rss(pid: int) -> int:
    """VmHWM of a live process in bytes (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def run_logged(cmd: list[str], log_path: str) -> int:
    """Run `cmd` from the repo root, output to `log_path`; returns the peak RSS it reached.
    Raises with the log's tail when it fails."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    print(f"$ {shlex.join(cmd)}  (log: {log_path})", flush=True)
    peak = [0]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

        def poll():
            while proc.poll() is None:
                peak[0] = max(peak[0], peak_rss(proc.pid))
                time.sleep(1.0)

        t = threading.Thread(target=poll, daemon=True)
        t.start()
        try:
            rc = proc.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.terminate()
            rc = proc.wait()
        t.join()
    if rc != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"{cmd[2]} failed (rc {rc}); log {log_path}:\n{tail}")
    return peak[0]


def _done(workdir: str) -> bool:
    """The arm finished under this bench (its RSS file is written after a clean exit); a
    dir without it is resumed by the training binary."""
    return os.path.exists(os.path.join(workdir, RSS_FILE))


def train_cmd(config: str, workdir: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "learner_jax.train", f"--config={config}",
            f"--workdir={workdir}", *args]  # fmt: skip


def prepare(
    root: str, sft_steps: int, rl_steps: int, lora_args: str = "", arm_args: str = "",
    fleet_eval_steps: int = 0,
):  # fmt: skip
    """Run the stages above (those not done yet); returns (lora_dir, full_dir)."""
    os.makedirs(root, exist_ok=True)
    sft, export = os.path.join(root, "sft"), os.path.join(root, "sft_export")
    if not os.path.exists(os.path.join(export, "config.json")):
        run_logged(
            train_cmd("configs/tiny_arith.py", sft,
                      [f"--config.sft.steps={sft_steps}", "--config.total_steps=0"]),
            os.path.join(root, "sft.log"),
        )  # fmt: skip
        run_logged(
            [sys.executable, "-m", "bridge.export", f"--checkpoint_dir={sft}/checkpoints",
             f"--step={sft_steps}", f"--output_dir={export}"],
            os.path.join(root, "export.log"),
        )  # fmt: skip
    common = [f"--config.model.hf_dir={export}", "--config.sft.steps=0",
              "--config.model.dtype=float32", *shlex.split(arm_args)]  # fmt: skip
    lora = [*common, *shlex.split(lora_args)]
    steps = f"--config.total_steps={rl_steps}"
    # LoRA first: its outcome is the open question, so it is known while the full arm runs.
    arms = {
        "lora": ("configs/tiny_arith_lora.py", [*lora, steps]),
        "full": ("configs/tiny_arith.py", [*common, steps]),
    }
    if fleet_eval_steps > 0:
        fleet = [*lora, f"--config.total_steps={fleet_eval_steps}", "--config.eval.on=fleet"]
        arms["lora_fleet_eval"] = ("configs/tiny_arith_lora.py", fleet)
    for arm, (config, args) in arms.items():
        workdir = os.path.join(root, arm)
        if _done(workdir):
            print(f"{arm}: {workdir} already ran (delete it to rerun)", flush=True)
            continue
        t0 = time.time()
        try:
            rss = run_logged(train_cmd(config, workdir, args), os.path.join(root, f"{arm}.log"))
        except RuntimeError as e:
            if arm in ("lora", "full"):
                raise
            print(f"{arm} failed (the arms' table still follows): {e}", flush=True)
            continue
        with open(os.path.join(workdir, RSS_FILE), "w") as f:
            json.dump({"peak_rss_bytes": rss, "wall_s": time.time() - t0, "args": args}, f)
    return os.path.join(root, "lora"), os.path.join(root, "full")


def fleet_eval_stats(workdir: str) -> dict:
    """What the `eval.on=fleet` LoRA stage shows: the workers' evaluations (version ->
    accuracy: eval.jsonl's "fleet" summaries), eval rows the learner audited under their adapter
    version, and the most workers ever quarantined (an eval worker whose log-probs were
    not the adapter's would be)."""
    from bench.lora_runs import _jsonl

    evals = [e for e in _jsonl(os.path.join(workdir, "eval.jsonl")) if e.get("type") == "summary"]
    rows = _jsonl(os.path.join(workdir, "metrics.jsonl"))
    return {
        "fleet_evals": {int(e["version"]): e["accuracy"] for e in evals},
        "audited_eval_rows": sum(r.get("audit/eval_rows", 0) for r in rows),
        "max_quarantined": max((r.get("fleet/quarantined", 0) for r in rows), default=0),
    }
