"""The provisioners behind the training binary's own workers (`config.fleet`, `local_workers`).

    cfg = run_config.fleet_config(config)          # the config's `fleet` section
    provs = make_provisioners(cfg, workdir, url, token_file, config.seed, config.local_workers)
    start_initial(provs, cfg, config.local_workers)

`fleet.provisioner = "local"` (default): rollout workers as processes on this machine
(bridge/fleet/local.py), worker i of `local_workers` taking prices[i % n] and
throttle_s[i % n], so the demo fleet has a fast, expensive worker and a slow, cheap one.
A provisioner's workers share one price (its limits and log bill by it), so each distinct
(price, throttle) pair gets its own LocalProvisioner; a dead worker is replaced by its own
kind. Names are `worker-<n>` with one pair, `worker-<a|b|..>-<n>` with several (distinct
prefixes: the provisioners share `<workdir>/provisioner.jsonl` and count names from it);
logs are `<workdir>/workers/<name>.log`.

`fleet.provisioner = "command"`: `local_workers` workers started and released by the
`fleet.start_command` / `fleet.stop_command` templates (bridge/fleet/command.py), billed at
`fleet.price_per_hour`. Either way `fleet.max_workers` and `fleet.max_usd_per_hour` bound
what may run at once. learner_jax/fleet/fleet.py keeps the fleet alive and following the
controller's activation decision.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os

from bridge.config.keys import SCHEMA
from bridge.fleet import skypilot
from bridge.fleet.command import CommandProvisioner
from bridge.fleet.local import LocalProvisioner, LocalWorkerSpec
from bridge.fleet.provisioner import Limits, Provisioner


@dataclasses.dataclass(frozen=True)
@SCHEMA.declared_fields
class FleetConfig:
    """The config's `fleet` section: every `fleet.*` key is a field, with the default and
    doc declared in bridge/config/keys.py (the worker's matching flags take the same)."""


def limits(cfg: FleetConfig, local_workers: int) -> Limits:
    return Limits(
        max_workers=cfg.max_workers or local_workers,
        max_usd_per_hour=cfg.max_usd_per_hour or math.inf,
    )


def local_specs(cfg: FleetConfig, seed: int) -> list[LocalWorkerSpec]:
    """One spec per distinct (price, throttle) pair, in the order workers take them."""
    n = max(len(cfg.prices), len(cfg.throttle_s))
    pairs = []
    for i in range(n):
        pair = (cfg.prices[i % len(cfg.prices)], cfg.throttle_s[i % len(cfg.throttle_s)])
        if pair not in pairs:
            pairs.append(pair)
    return [
        LocalWorkerSpec(
            price_per_hour=price,
            throttle_s=throttle,
            max_num_seqs=cfg.max_num_seqs,
            threads=cfg.threads,
            cpus=cfg.worker_cpus,
            kvcache_gib=cfg.kvcache_gib,
            grace_s=cfg.grace_s,
            # Worker n of kind k samples with seed (seed * 100 + k) * 1000 + n: distinct
            # across kinds and workers, reproducible per run.
            seed=seed * 100 + k,
            extra_flags=_engine_flags(cfg),
        )
        for k, (price, throttle) in enumerate(pairs)
    ]


def _engine_flags(cfg: FleetConfig) -> tuple[str, ...]:
    flags = (f"--max_model_len={cfg.max_model_len}",) if cfg.max_model_len else ()
    return flags + ((f"--dtype={cfg.engine_dtype}",) if cfg.engine_dtype else ())


def initial_counts(cfg: FleetConfig, n: int) -> list[int]:
    """How many of the first `n` workers each provisioner of `make_provisioners` starts."""
    if cfg.provisioner == "command":
        return [n]
    if cfg.provisioner == "skypilot":  # each profile's count (make_provisioners checks n)
        return [p.count for p in skypilot.load_profiles(cfg.skypilot_fleet)]
    m = max(len(cfg.prices), len(cfg.throttle_s))
    pairs = [
        (cfg.prices[i % len(cfg.prices)], cfg.throttle_s[i % len(cfg.throttle_s)]) for i in range(m)
    ]
    kinds = list(dict.fromkeys(pairs))
    counts = [0] * len(kinds)
    for i in range(n):
        counts[kinds.index(pairs[i % m])] += 1
    return counts


def make_provisioners(
    cfg: FleetConfig, workdir: str, url: str, token_file: str, seed: int, local_workers: int
) -> list[Provisioner]:
    if local_workers < 0:
        raise ValueError(f"local_workers must be >= 0, got {local_workers}")
    lim = limits(cfg, local_workers)
    if cfg.provisioner == "command":
        if not (cfg.start_command and cfg.stop_command):
            raise ValueError(
                "fleet.provisioner='command' needs fleet.start_command and stop_command"
            )
        return [
            CommandProvisioner(
                workdir,
                url,
                token_file,
                start=cfg.start_command,
                stop=cfg.stop_command,
                status=cfg.status_command or None,
                price_per_hour=cfg.price_per_hour,
                limits=lim,
            )
        ]
    if cfg.provisioner == "skypilot":
        return _skypilot(cfg, workdir, url, token_file, local_workers)
    if cfg.provisioner != "local":
        raise ValueError(
            f"fleet.provisioner must be 'local', 'command' or 'skypilot', got {cfg.provisioner!r}"
        )
    specs = local_specs(cfg, seed)
    return [
        LocalProvisioner(
            workdir,
            url,
            token_file,
            spec,
            limits=lim,
            prefix="worker-" if len(specs) == 1 else f"worker-{chr(ord('a') + k)}-",
        )
        for k, spec in enumerate(specs)
    ]


def _skypilot(cfg: FleetConfig, workdir: str, url: str, token_file: str, n: int):
    """One SkyPilot provisioner per profile of `fleet.skypilot_fleet` (rented workers)."""
    if not cfg.skypilot_fleet:
        raise ValueError("fleet.provisioner='skypilot' needs fleet.skypilot_fleet (profiles JSON)")
    profiles = skypilot.load_profiles(cfg.skypilot_fleet)
    if n != sum(p.count for p in profiles):
        raise ValueError(
            f"local_workers={n} but the profiles in {cfg.skypilot_fleet} add up to "
            f"{sum(p.count for p in profiles)} workers: set local_workers to their sum"
        )
    opts = skypilot.TaskOptions(url, token_file, max_model_len=cfg.max_model_len)
    return skypilot.make_provisioners(
        profiles, workdir, opts, max_usd_per_hour=cfg.max_usd_per_hour or math.inf
    )


def start_initial(provs: list[Provisioner], cfg: FleetConfig, n: int) -> None:
    """Start the run's first `n` workers (worker i of the kind i % len(prices))."""
    for prov, count in zip(provs, initial_counts(cfg, n), strict=True):
        for h in prov.start(count, f"local_workers={n}"):
            logging.info(
                "%s: $%.2f/h, %s (log %s)",
                h.name,
                h.price_per_hour,
                f"pid {h.info['pid']}" if "pid" in h.info else "started",
                os.path.join(prov.workdir, "workers", f"{h.name}.log"),
            )
