"""Real rollout worker processes for the fleet tests (`python -m rollout_gpu.worker`), a
controller on loopback serving the tiny Qwen3 for them, and polling on state instead of
sleeping."""

import os
import subprocess
import sys
import time

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


def wait_for(what, ok, timeout_s=180.0, logs=None, every_s=0.05):
    """Poll `ok()` until it returns something truthy (returned); fail with the logs after
    `timeout_s`. The timeout is a hang guard, not a synchronization point."""
    deadline = time.monotonic() + timeout_s
    while not (v := ok()):
        assert time.monotonic() < deadline, f"{what}\n{tail(logs or {})}"
        time.sleep(every_s)
    return v


def serve_tiny(workdir, seed=0, **overrides):
    """A controller on 127.0.0.1 (arithmetic, the tiny model's tokenizer) whose store holds
    version 0 of the tiny Qwen3 with weights `seed` (published: workers swap it in)."""
    from bridge.contracts.prompt import TextCodec
    from bridge.control.config import ControllerConfig
    from bridge.control.controller import Controller
    from bridge.control.http.service import ServerOptions, serve_controller
    from bridge.control.protocol import SamplingParams
    from bridge.model import tiny_model
    from bridge.store.weight_store import WeightStore
    from bridge.tasks import make_task

    cfg = tiny_model.tiny_config("qwen3")
    spec = f"file://{workdir}/store"
    weights = tiny_model.random_hf_weights(cfg, seed=seed)
    WeightStore(spec).publish(0, 0, weights.items(), model_config=cfg.to_hf_dict(), dtype="float32")
    tokenizer = os.path.join(workdir, "tokenizer")
    os.makedirs(tokenizer, exist_ok=True)
    tiny_model.save_tokenizer(tokenizer)
    config = ControllerConfig(
        **{
            "staleness": 2000,  # nothing is consumed here: admission never fills up
            "groups_per_step": 2,
            "group_size": 2,
            "sampling": SamplingParams(max_tokens=4),
            "vocab_size": cfg.vocab_size,
            "heartbeat_interval_s": 0.5,
            **overrides,
        }
    )
    db = os.path.join(workdir, "controller.db")
    ctl = Controller(config, db, make_task("arithmetic"), codec=TextCodec(tokenizer))
    server = serve_controller(ctl, workdir, ServerOptions(host="127.0.0.1", port=0))
    ctl.publish(0, store=spec)
    return ctl, server


def leases(ctl, worker_id=None, state=None):
    """The controller's lease rows (of one worker, in one state), oldest first."""
    where = [("worker_id=?", worker_id), ("state=?", state)]
    where = [(w, v) for w, v in where if v is not None]
    sql = "SELECT * FROM leases" + (" WHERE " + " AND ".join(w for w, _ in where) if where else "")
    return ctl.db.q(sql + " ORDER BY created_at", tuple(v for _, v in where))
