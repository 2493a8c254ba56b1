"""Rollout workers as processes on this machine (the training binary's `local_workers`).

    prov = LocalProvisioner(workdir, url, token_file, LocalWorkerSpec(price_per_hour=1.0))
    prov.start(2, "local_workers=2")

Each worker is `python -m rollout_gpu.worker` (the learner never imports vLLM or torch)
joined with the join secret file only, exactly like a remote one, with the command line,
environment and log files of learner_jax/local_fleet.py: `threads` OpenMP/torch threads,
vLLM's in-process engine, no JAX flags, model files from the weight store into
`<workdir>/workers/model_files`, the log in `<workdir>/workers/<name>.log`, its own
process group (a Ctrl-C in the terminal reaches the learner only, which stops the
workers in order). `stop` sends SIGTERM (finish or release the lease, leave) and returns;
`poll` kills a worker still alive `grace_s` later.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

from bridge.config.keys import SCHEMA
from bridge.control.trust.identity import LOCAL
from bridge.fleet.provisioner import Limits, Provisioner, WorkerHandle


@dataclasses.dataclass(frozen=True)
@SCHEMA.declared_fields
class LocalWorkerSpec:
    """One kind of local worker. Also fields: price_per_hour, throttle_s, max_num_seqs,
    threads, kvcache_gib, grace_s, with the worker flags' defaults (bridge/config/keys.py)."""

    cpus: tuple[int, ...] = ()  # pinned to these CPUs (empty: any)
    accelerator: str = "cpu"
    seed: int = 0  # worker n samples with seed * 1000 + n
    model_dir: str | None = None  # default: the weight store's model files
    extra_flags: tuple[str, ...] = ()


def worker_command(
    spec: LocalWorkerSpec, url: str, token_file: str, log_dir: str, name: str, n: int
):
    cmd = [
        sys.executable,
        "-m",
        "rollout_gpu.worker",
        f"--controller={url}",
        f"--token_file={token_file}",
        f"--cache_dir={os.path.join(log_dir, 'model_files')}",
        f"--price_per_hour={spec.price_per_hour}",
        f"--accelerator={spec.accelerator}",
        f"--max_num_seqs={spec.max_num_seqs}",
        f"--throttle_s={spec.throttle_s}",
        f"--seed={spec.seed * 1000 + n}",
        f"--cpu_kvcache_gib={int(spec.kvcache_gib)}",
        f"--grace_s={spec.grace_s}",
        f"--name={name}",
        "--exit_with_parent",  # a learner killed -9 leaves no worker serving nobody
    ]
    if spec.model_dir:
        cmd.append(f"--model_dir={spec.model_dir}")
    return cmd + list(spec.extra_flags)


def worker_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
    )
    env.pop("XLA_FLAGS", None)  # JAX-only; the worker never imports jax
    return env


def _pin(cpus: tuple[int, ...]):
    """A preexec_fn pinning the child to `cpus` (None: not pinned)."""
    if not cpus:
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"fleet.worker_cpus={cpus}: this OS cannot pin processes (Linux only)")
    if not set(cpus) <= set(range(os.cpu_count() or 1)):
        raise ValueError(f"fleet.worker_cpus={cpus}: this machine has CPUs 0-{os.cpu_count() - 1}")
    return lambda: os.sched_setaffinity(0, cpus)


class LocalProvisioner(Provisioner):
    def __init__(
        self,
        workdir: str,
        controller_url: str,
        token_file: str,
        spec: LocalWorkerSpec,
        limits: Limits | None = None,
        prefix: str = "worker-",
    ):
        super().__init__(workdir, spec.price_per_hour, limits, prefix)
        self.url, self.token_file, self.spec = controller_url, token_file, spec
        self.log_dir = os.path.join(workdir, "workers")
        os.makedirs(self.log_dir, exist_ok=True)
        self._procs: dict[str, subprocess.Popen] = {}
        self._kill_at: dict[str, float] = {}

    def identity(self, handle: WorkerHandle) -> str:
        return LOCAL  # the join secret from loopback: the operator's own machine

    def _launch(self, name: str) -> dict:
        n = int(name[len(self.prefix) :]) if name[len(self.prefix) :].isdigit() else 0
        cmd = worker_command(self.spec, self.url, self.token_file, self.log_dir, name, n)
        log_path = os.path.join(self.log_dir, f"{name}.log")
        with open(log_path, "ab") as log:  # the child keeps its own descriptor
            p = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=worker_env(self.spec.threads),
                start_new_session=True,
                preexec_fn=_pin(self.spec.cpus),
            )
        self._procs[name] = p
        return {"pid": p.pid, "log": log_path}

    def _release(self, handle: WorkerHandle) -> None:
        p = self._procs[handle.name]
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            self._kill_at[handle.name] = time.monotonic() + self.spec.grace_s + 5.0

    def _exit_code(self, handle: WorkerHandle) -> int | None:
        return self._procs[handle.name].poll()

    def poll(self) -> list[WorkerHandle]:
        for name, at in list(self._kill_at.items()):  # stopped but not gone: kill
            p = self._procs[name]
            if p.poll() is not None:
                del self._kill_at[name]
            elif time.monotonic() > at:
                p.kill()
        return super().poll()

    def wait(self, timeout_s: float) -> bool:
        """Wait until every process exited (killing stopped ones past their grace)."""
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in self._procs.values()):
            if time.monotonic() > deadline:
                return False
            self.poll()
            time.sleep(0.1)
        return True
