"""Real rollout worker processes for the fleet tests (`python -m rollout_gpu.worker`)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def spawn_worker(url, workdir, model_dir, region, seed, extra=()):
    """Start one worker joined with `<workdir>/join_token`; returns (process, log path)."""
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
    )
    log = os.path.join(workdir, f"worker_{region}.log")
    cmd = [
        sys.executable,
        "-m",
        "rollout_gpu.worker",
        f"--controller={url}",
        f"--token_file={os.path.join(workdir, 'join_token')}",
        f"--model_dir={model_dir}",
        "--max_num_seqs=8",
        f"--region={region}",
        f"--seed={seed}",
        "--max_model_len=256",
        *extra,
    ]
    f = open(log, "w")  # noqa: SIM115 - kept open for the process's lifetime
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT), log


def tail(logs: dict[str, str], lines: int = 30) -> str:
    """The last lines of each worker's log, for assertion messages."""
    out = []
    for name, path in logs.items():
        with open(path) as f:
            out.append(f"--- {name} ---\n" + "".join(f.readlines()[-lines:]))
    return "\n".join(out)
