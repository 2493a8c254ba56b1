"""Multi-process learner: JAX's distributed runtime (`DistributedConfig`, built from the
config's `distributed` section by `run_config.distributed_config`), and the few host-side
primitives the other modules need (who leads, barriers).

    python -m learner_jax.train --config=configs/tiny_arith.py --workdir=/shared/run \
        --config.distributed.coordinator_address=10.0.0.1:8476 \
        --config.distributed.num_processes=2 --config.distributed.process_id=$RANK

Every process runs the same binary; `jax.distributed.initialize` connects them and
`jax.devices()` then lists every process's devices, so the mesh (`run_config.make_mesh`) spans
them all. All three keys unset (``""``, 0, -1) means one process, unless JAX detects a
cluster itself (SLURM, Open MPI, TPU pod slices; `distributed.auto = True`), in which
case it fills in what is missing.

On CPU the cross-process collectives are gloo's (`jax_cpu_collectives_implementation`),
so 2 processes x 4 virtual CPU devices run on loopback (tests/learner_jax/multihost_test.py).

Failure: each process heartbeats to the coordinator (process 0). When one dies, the
coordination service reports the others' missing peer within `heartbeat_timeout_s` and
JAX terminates them with a non-zero status and a message naming the lost task; a process
blocked in a collective or a barrier does not hang past that.

Barriers here are the coordination service's (`wait_at_barrier`), not device collectives:
they are safe from any thread (the background publisher's), where a device collective
could interleave with the train step's on another thread and deadlock.
"""

from __future__ import annotations

import dataclasses
import logging

import jax

from bridge.config.keys import SCHEMA

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
@SCHEMA.declared_fields
class DistributedConfig:
    """`config.distributed`: every `distributed.*` key (bridge/config/keys.py)."""

    def __post_init__(self):
        explicit = (bool(self.coordinator_address), self.num_processes > 0, self.process_id >= 0)
        if any(explicit) and not all(explicit) and not self.auto:
            raise ValueError(
                "distributed.coordinator_address, num_processes and process_id go together "
                f"(or set distributed.auto = True to let JAX detect the rest), got {self}"
            )
        if self.num_processes > 0 and not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process_id {self.process_id} not in [0, {self.num_processes})")
        if self.heartbeat_timeout_s < 1:
            raise ValueError(f"heartbeat_timeout_s must be >= 1, got {self.heartbeat_timeout_s}")

    @property
    def enabled(self) -> bool:
        return self.auto or self.num_processes > 1


_STATE = {"initialized": False}


def initialize(cfg: DistributedConfig) -> None:
    """Connect this process to the others (idempotent; a no-op for one process)."""
    if not cfg.enabled or _STATE["initialized"]:
        return
    # Cross-process collectives of CPU computations (gloo is JAX 0.10's default; set so a
    # CPU mesh spanning processes never depends on it). GPU/TPU computations ignore it.
    jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
    kwargs = dict(
        initialization_timeout=cfg.initialization_timeout_s,
        heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
    )
    if cfg.num_processes > 0:
        kwargs.update(
            coordinator_address=cfg.coordinator_address or None,
            num_processes=cfg.num_processes,
            process_id=cfg.process_id,
        )
    jax.distributed.initialize(**kwargs)
    _STATE["initialized"] = True
    log.info(
        "process %d of %d: %d local / %d global devices",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )


def is_leader() -> bool:
    """Process 0 hosts the controller, writes metrics, reports and manifests."""
    return jax.process_index() == 0


def multi_process() -> bool:
    return jax.process_count() > 1


def barrier(name: str, timeout_s: float = 600) -> None:
    """Every process reaches `name` before any passes (no-op for one process).

    Names must be unique per use (the coordination service refuses a reused one).
    """
    if not multi_process():
        return
    from jax._src import distributed as _dist  # the client has no public accessor

    _dist.global_state.client.wait_at_barrier(name, int(timeout_s * 1000))
