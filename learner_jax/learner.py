"""The learner object the training binary drives: sharded state + jitted steps + checkpoints.

Built from the config: mesh and logical rules, the policy (from `model.hf_dir`, or the
tiny model written into `<workdir>/model`), one optimizer per phase, the train state
(restored from the latest checkpoint in `<workdir>/checkpoints` when there is one), and
the metrics writer. Phases:

    sft  next-token loss on a task's (prompt, answer) pairs (the warm start)
    rl   the policy loss of `config.loss.name` on trajectories from the rollout fleet

`state.step` counts every optimizer update of both phases (it is the checkpoint step and
the metrics `step`); each phase starts a fresh optimizer state, so warmup and the
learning-rate schedule restart at the RL boundary. The two optimizers have the same
structure (only hyper-parameters differ), so one restore target fits both.

The checkpoint cursor holds {"phase", "sft_consumed", "rl_start_step", "rl": <blob>},
where the "rl" blob is whatever the RL loop (the controller's state) hands in.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from bridge import export as hf_export
from bridge.model.config import ModelConfig
from learner_jax import lora, lora_state
from learner_jax.model import hf_import
from learner_jax.model.dtypes import publish_dtype
from learner_jax.model.model_dir import prepare_model_dir
from learner_jax.multihost import distributed
from learner_jax.reporting import compiles, console, wandb_sink
from learner_jax.reporting.metrics import MetricsWriter
from learner_jax.run_config import (
    PHASES,
    check_batch_sizes,
    checkpoint_config,
    make_mesh,
    optimizer_config,
    sharding_rules,
    step_config,
)
from learner_jax.training import (
    checkpoint,
    optim,
    packing,
    reference_policy,
    train_state,
    train_step,
)

if TYPE_CHECKING:
    from learner_jax.multihost.mirror import Leader


class Learner:
    """Holds the train state and runs steps; only this object mutates `state`."""

    def __init__(self, config, workdir: str):
        self.config, self.workdir = config, workdir
        self.rules = sharding_rules(config)
        self.mesh = make_mesh(config)
        check_batch_sizes(config, self.mesh)
        self.hf_dir = prepare_model_dir(config, workdir)
        self.model_cfg: ModelConfig = ModelConfig.from_hf_dir(self.hf_dir)
        self.param_dtype = jnp.dtype(config.model.param_dtype)
        self.publish_dtype = jnp.dtype(publish_dtype(config))  # versions in the store
        opt_cfgs = {p: optimizer_config(config, p) for p in PHASES}
        self.optimizers = {p: optim.make_optimizer(c) for p, c in opt_cfgs.items()}
        self.schedules = {p: optim.make_schedule(c) for p, c in opt_cfgs.items()}
        self.lora = lora.from_config(config)  # None: full-weight training
        self.abstract, self.shardings = train_state.state_shardings(
            self.model_cfg,
            self.optimizers["rl"],
            self.mesh,
            self.rules,
            self.param_dtype,
            self.lora,
        )
        self.ckpt = checkpoint.Checkpointer(
            checkpoint.checkpoint_dir(workdir),
            checkpoint_config(config),
        )
        if jax.process_index() == 0:
            # config + tokenizer beside the checkpoints, so `python -m bridge.export
            # --checkpoint_dir=...` needs nothing else (hf_dir may be elsewhere, or gone).
            hf_export.save_model_files(self.hf_dir, self.ckpt.directory)
        self._steps: dict[str, Any] = {}
        first = "sft" if config.sft.steps > 0 else "rl"
        self.cursor = {"phase": first, "sft_consumed": 0, "rl_start_step": 0, "rl": {}}
        base = None  # LoRA: the frozen base comes from hf_dir, on resume too
        if self.lora is not None or self.ckpt.latest_step() is None:
            _, base = hf_import.load_hf_params(self.hf_dir, self.mesh, self.rules, self.param_dtype)
        if self.ckpt.latest_step() is not None:
            lora_state.check_resume(self.ckpt.restore_cursor(), self.hf_dir, self.lora)
            target = self.abstract if self.lora is None else self.abstract.replace(frozen=base)
            self.state, self.cursor = self.ckpt.restore(target)
            logging.info(
                "resumed from step %d (%s)",
                int(self.state.step),
                self.cursor["phase"],
                extra=console.SHOW,
            )
        else:
            self.state = train_state.state_from_params(
                self.model_cfg,
                base,
                self.optimizers[first],
                self.mesh,
                self.rules,
                config.seed,
                self.param_dtype,
                self.lora,
            )
            if self.lora is not None:  # the checkpoints' reference to the base
                self.cursor[lora_state.CURSOR_KEY] = lora_state.base_reference(
                    self.hf_dir, self.lora
                )
        if self.lora is not None:
            self._merge = lora_state.merge_fn(self.lora, self.shardings.frozen)
            if first == "rl":
                self.cursor["rl_start_step"] = 0
        # The KL penalty's frozen reference policy (reference_policy.py); None without it.
        self.reference = None
        if self.phase == "rl":
            self._load_reference(fresh=self.ckpt.latest_step() is None)
        # Only process 0 writes metrics lines (every process computes the same numbers).
        self.metrics = (
            MetricsWriter(workdir, sinks=wandb_sink.sinks_for(config, workdir))
            if distributed.is_leader()
            else None
        )
        self._last_line = time.perf_counter()
        self._compiles = compiles.count()
        self._busy = 0.0
        # Process 0 of a multi-process RL run: announces each step and save to the other
        # processes before running it; the training binary sets it
        # (learner_jax/multihost/mirror.py).
        self.mirror: Leader | None = None

    @property
    def step(self) -> int:
        return int(self.state.step)

    @property
    def policy_params(self):
        """The policy's full parameter tree (what is published and evaluated): the trained
        params, or with LoRA the base with the adapters merged into its kernels."""
        if self.lora is None:
            return self.state.params
        return self.policy_of(self.state.params)

    def policy_of(self, adapters):
        """LoRA: the base with `adapters` (a tree like `state.params`) merged in."""
        return self._merge(self.state.frozen, adapters)

    @property
    def rl_steps(self) -> int:
        """RL updates done so far (the RL policy version), 0 during SFT."""
        return 0 if self.phase == "sft" else self.step - self.cursor["rl_start_step"]

    @property
    def phase(self) -> str:
        return self.cursor["phase"]

    def _step_fn(self, phase: str):
        if phase not in self._steps:
            self._steps[phase] = train_step.jit_step(
                self.model_cfg,
                self.optimizers[phase],
                step_config(self.config, phase),
                self.mesh,
                self.shardings,
                self.rules,
            )
        return self._steps[phase]

    def start_rl(self) -> None:
        """Leave the SFT phase: fresh RL optimizer state, checkpoint the boundary."""
        if self.phase == "rl":
            return
        init = jax.jit(self.optimizers["rl"].init, out_shardings=self.shardings.opt_state)
        self.state = self.state.replace(opt_state=init(self.state.params))
        self.cursor.update(phase="rl", rl_start_step=self.step)
        self._load_reference(fresh=True)
        self.save(force=True)

    def _load_reference(self, fresh: bool) -> None:
        """The reference policy as the RL phase starts (`fresh`: snapshot and save the
        current params), or the saved one on resume; nothing without a KL penalty."""
        if not train_step.needs_reference(step_config(self.config, "rl")):
            return
        if fresh:
            self.reference = reference_policy.snapshot(self.state.params, self.shardings.params)
            reference_policy.save(self.workdir, self.reference)
        else:
            self.reference = reference_policy.restore(self.workdir, self.abstract.params)

    def train_step(self, batch: train_step.Batch, wait_s: float = 0.0) -> dict:
        """One optimizer update of the current phase; returns its metrics (host floats)."""
        if self.mirror is not None:
            self.mirror.step(batch)
        fn = self._step_fn(self.phase)
        start = 0 if self.phase == "sft" else self.cursor["rl_start_step"]
        lr = float(self.schedules[self.phase](self.step - start))  # this update's rate
        if self.config.batch.get("packing", False):  # memory set by tokens, not longest row
            batch = packing.pack_batch(
                batch,
                step_config(self.config, self.phase).micro_batches,
                self.mesh.shape["data"] * self.mesh.shape["fsdp"],
                self.config.batch.get("pack_len", 0) or None,
            )
        t0 = time.perf_counter()
        batch = train_step.put_batch(batch, self.mesh, self.rules)
        if self.phase == "rl" and self.reference is not None:  # the KL penalty
            scale = reference_policy.kl_scale(
                self.config.loss, self.rl_steps, self.config.total_steps
            )  # this step's beta is the step's `kl_coef` metric
            self.state, out = fn(self.state, batch, self.reference, scale)
        else:
            self.state, out = fn(self.state, batch)
        out = jax.device_get(out)
        dt = time.perf_counter() - t0
        self._busy += dt
        now = time.perf_counter()
        # Per-row audit sums (RL steps) stay arrays, for the controller's worker audit.
        self.last_rows = {
            k[len(train_step.ROWS) :]: out.pop(k)
            for k in list(out)
            if k.startswith(train_step.ROWS)
        }
        metrics = {k: float(v) for k, v in out.items()}
        metrics.update(
            {
                "phase": self.phase,
                "learning_rate": lr,
                "time/step_s": dt,
                "time/wait_s": wait_s,
                "learner/utilization": self._busy / max(now - self._last_line, 1e-9),
            }
        )
        return metrics

    def utilization(self) -> float:
        """Fraction of the wall time since the previous metrics line spent in train steps."""
        return self._busy / max(time.perf_counter() - self._last_line, 1e-9)

    def log(self, metrics: dict) -> dict:
        """Write one metrics line for the current step and reset the utilization window.

        Utilization is re-measured here, over the whole window since the previous line, so
        the work between the update and the line (publishing weights, evaluation) counts
        as learner idle time, as the metric's contract says.
        """
        if "learner/utilization" in metrics:
            # time/compiled: XLA compiled in this line's window, a one-off that the live
            # capacity model leaves out (compiles.py), and so does its check against the run.
            seen, self._compiles = self._compiles, compiles.count()
            compiled = int(self._compiles > seen)
            metrics = {
                **metrics,
                "learner/utilization": self.utilization(),
                "time/compiled": compiled,
            }
        if self.metrics is not None:
            row = self.metrics.write(self.step, metrics)
        else:
            row = {"step": self.step, **{k: v for k, v in metrics.items() if k != "step"}}
        self._last_line, self._busy = time.perf_counter(), 0.0
        return row

    def save(self, force: bool = False) -> bool:
        if self.mirror is not None:
            self.mirror.save(force)
        return self.ckpt.save(self.step, self.state, self.cursor, force=force)

    def close(self) -> None:
        self.ckpt.close()
        if self.metrics is not None:
            self.metrics.close()
