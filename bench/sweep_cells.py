"""Many short RL runs ("cells") in one process, fed by one standing pool of workers.

    pool = Pool(config, pool_dir, throttle_s=1.0)   # two local vLLM workers, started once
    secs = run_cell(config, workdir, pool)           # the training binary's run(), in-process
    pool.close()

What a cell is: `learner_jax.train.run(config, workdir)` -- the product's own RL loop, with
its own controller (own process, own database, the real staleness rule and leases),
weight publisher, evaluations and report -- started from a copy of an SFT warm start.
What the cells share, so each pays only its own RL steps:
- the Python process: JAX, the learner's modules and the task are imported once;
- compiled programs: JAX's persistent compilation cache (`enable_compile_cache`), so
  every learner after the first of a (model, correction, batch) shape loads its train
  step, evaluator and publisher programs instead of compiling them;
- the workers: two `rollout_gpu.worker` processes (bridge/fleet/local.py, exactly the
  binary's local workers: fast $0.40/h + throttled $0.15/h) joined to a fixed controller
  address and join secret. Every cell serves that address (`controller.port`,
  `controller.token_file`), runs with `local_workers=0` and ends with
  `controller.tell_run_over=False` (learner_jax/rl/serve.py `end_run`): the workers are
  not sent home, see the controller go away and meet the next cell's controller as after
  a crash -- a fresh database that refuses their token (they register again) and their
  old leases, announces the warm start's version (they swap back to it: a registration's
  announcement is authoritative, rollout_gpu/versions.py) and refuses work from any
  other version as "from the future" (tests/learner_jax/rl/serve_test.py).
A pool serves one model (vLLM is started on its shape), so a sweep starts one per task.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import secrets
import shutil
import signal
import socket
import threading
import time

import jax


def enable_compile_cache(path: str) -> None:
    """JAX's persistent compilation cache in `path`, for every program however quick."""
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def load(config_file: str, overrides: list[str]):
    """`config_file`'s config with KEY=VALUE overrides, as `--config.KEY=VALUE` sets them
    (VALUE a Python literal, else a string)."""
    from learner_jax.config_file import load_config

    config = load_config(config_file)
    for kv in overrides:
        key, _, text = kv.partition("=")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            value = text
        *path, last = key.split(".")
        node = config
        for part in path:
            node = node[part]
        if last not in node:
            raise KeyError(f"unknown config key {key!r} in {config_file}")
        node[last] = value
    return config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Pool:
    """Two local workers (the second throttled by `throttle_s` per lease, the first by
    `fast_throttle_s`) that serve every cell at one controller address; `overrides()` are
    what each cell's config needs."""

    def __init__(
        self, config, pool_dir: str, throttle_s: float, seed: int = 0, fast_throttle_s: float = 0.0
    ):
        from bridge.fleet.local import LocalProvisioner
        from learner_jax import run_config
        from learner_jax.fleet import local_fleet

        shutil.rmtree(pool_dir, ignore_errors=True)
        os.makedirs(pool_dir)
        self.port = free_port()
        self.token_file = os.path.join(pool_dir, "join_token")
        fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        url = f"http://127.0.0.1:{self.port}"
        fleet = dataclasses.replace(
            run_config.fleet_config(config),
            prices=(0.40, 0.15),
            throttle_s=(fast_throttle_s, throttle_s),
        )
        self.provs = []
        for k, spec in enumerate(local_fleet.local_specs(fleet, seed)):
            # between cells the controller is away for seconds: retry every second or two
            spec = dataclasses.replace(spec, extra_flags=(*spec.extra_flags, "--max_backoff_s=2"))
            prov = LocalProvisioner(
                pool_dir, url, self.token_file, spec, limits=local_fleet.limits(fleet, 2),
                prefix=f"pool-{'ab'[k]}-",
            )  # fmt: skip
            prov.start(1, "staleness sweep pool")
            self.provs.append(prov)
        self.pool_dir = pool_dir

    def overrides(self) -> list[str]:
        return [
            "local_workers=0",
            f"controller.port={self.port}",
            f"controller.token_file={self.token_file}",
            "controller.tell_run_over=False",
        ]

    def check(self) -> None:
        """Fail loudly if a pool worker died (a cell would wait for batches forever)."""
        for prov in self.provs:
            prov.poll()
            if not prov.alive():
                logs = os.path.join(self.pool_dir, "workers")
                raise RuntimeError(f"a pool worker exited: see {logs}")

    def close(self) -> None:
        for prov in self.provs:
            prov.stop_all("staleness sweep done")
        for prov in self.provs:
            prov.wait(60.0)


def copy_warm_start(base: str, workdir: str) -> None:
    """`workdir` = the SFT warm start `base` without its metrics (bench/arms.py's arms)."""
    shutil.rmtree(workdir, ignore_errors=True)
    shutil.copytree(base, workdir)
    for stale in ("metrics.jsonl", "eval.jsonl", "tb", "train.log", "controller.db"):
        path = os.path.join(workdir, stale)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)


def run_cell(config, workdir: str, pool: Pool, stop_after: int = 0) -> float:
    """The training binary's run() on `workdir` (a warm start's copy) with the pool's
    workers; returns its wall time. `stop_after` > 0: Ctrl-C (the binary's own SIGINT
    path: finish the step, checkpoint, shut down) once that many RL steps are logged -- a
    warm-up with the real cells' exact config, so their programs come from the cache."""
    from learner_jax import train

    pool.check()
    done, died = threading.Event(), []
    if stop_after:
        threading.Thread(target=_interrupt_after, args=(workdir, stop_after, done)).start()
    threading.Thread(target=_interrupt_if_died, args=(pool, done, died), daemon=True).start()
    t0 = time.monotonic()
    try:
        train.run(config, workdir)
    except KeyboardInterrupt:  # stopped before the run took Ctrl-C as a request to stop
        if not died:
            raise
    finally:
        done.set()
    if died:  # the run was stopped: without workers it would have waited for data forever
        raise died[0]
    return time.monotonic() - t0


def _interrupt_if_died(pool: Pool, done: threading.Event, died: list) -> None:
    """Ctrl-C the cell (the binary's own stop) once a pool worker has exited: a worker that
    cannot start (a model length vLLM refuses) left the run waiting for data forever."""
    while not done.wait(1.0):
        try:
            pool.check()
        except RuntimeError as e:
            died.append(e)
            os.kill(os.getpid(), signal.SIGINT)
            return


def _interrupt_after(workdir: str, steps: int, done: threading.Event) -> None:
    from learner_jax.reporting import report

    while not done.wait(0.2):
        try:
            if len(report.rl_rows(workdir)) >= steps:
                os.kill(os.getpid(), signal.SIGINT)
                return
        except (OSError, ValueError):  # metrics.jsonl not there yet, or a line half-written
            pass
