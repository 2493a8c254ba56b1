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
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp

from bridge import export as hf_export
from bridge.contracts.prompt import PromptFormat
from bridge.model import tiny_model
from bridge.model.config import ModelConfig
from learner_jax import (
    checkpoint,
    console,
    distributed,
    hf_import,
    losses,
    model,
    optim,
    packing,
    sharding,
    train_state,
    train_step,
)
from learner_jax.metrics import MetricsWriter

PHASES = ("sft", "rl")


def optimizer_config(config, phase: str) -> optim.OptimizerConfig:
    o = config.optimizer
    common = dict(
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        weight_decay=o.weight_decay,
        max_grad_norm=o.max_grad_norm,
        end_lr_fraction=o.end_lr_fraction,
    )
    if phase == "sft":
        steps = max(config.sft.steps, 1)
        warmup = min(config.sft.warmup_steps, steps - 1)
        return optim.OptimizerConfig(
            learning_rate=config.sft.learning_rate,
            warmup_steps=warmup,
            total_steps=steps,
            **{**common, "end_lr_fraction": config.sft.get("end_lr_fraction", o.end_lr_fraction)},
        )
    steps = max(config.total_steps, 1)
    return optim.OptimizerConfig(
        learning_rate=o.learning_rate,
        warmup_steps=min(o.warmup_steps, steps - 1),
        total_steps=steps,
        **common,
    )


def step_config(config, phase: str) -> train_step.StepConfig:
    options = model_options(config)
    if phase == "sft":
        micro = config.sft.batch_size // config.sft.micro_batch_size
        return train_step.StepConfig(
            kind="sft", micro_batches=micro, dtype=compute_dtype(config), model_options=options
        )
    rows = config.batch.groups_per_step * config.batch.samples_per_group
    return train_step.StepConfig(
        kind="rl",
        loss=losses.LossConfig(**config.loss.to_dict()),
        micro_batches=rows // config.batch.micro_batch_size,
        dtype=compute_dtype(config),
        model_options=options,
        temperature=float(config.rollout.temperature),
    )


def compute_dtype(config) -> str:
    """`model.dtype`; 'auto' = bfloat16 compute for a real model (`model.hf_dir` set) and
    float32 for the tiny demo model. Parameters (the master weights the optimizer updates)
    stay in `model.param_dtype` (float32 by default) either way: every matmul casts them
    to the compute dtype, so bf16 runs keep fp32 updates exact (no lost small steps)."""
    dtype = config.model.dtype
    if dtype == "auto":
        return "bfloat16" if config.model.hf_dir else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"model.dtype must be auto|float32|bfloat16|float16, got {dtype!r}")
    return dtype


def model_options(config) -> model.ModelOptions:
    """Attention implementation and rematerialization (learner_jax/attention.py, model.py)."""
    return model.ModelOptions(attention=config.model.attention, remat=config.model.remat)


def check_batch_sizes(config, mesh) -> None:
    """Fail before any compile when the batch does not split over micro-batches and mesh."""
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    rows = config.batch.groups_per_step * config.batch.samples_per_group
    for name, total, micro in (
        ("batch", rows, config.batch.micro_batch_size),
        ("sft", config.sft.batch_size, config.sft.micro_batch_size),
    ):
        if micro <= 0 or total % micro or micro % shards:
            raise ValueError(
                f"{name}: micro-batch size {micro} must divide the global batch {total} "
                f"and be a multiple of data*fsdp = {shards}"
            )


def sharding_rules(config) -> sharding.Rules:
    """The config's `sharding_rules` if it sets them, else `sharding.DEFAULT_RULES`.

    The table has one home, learner_jax/sharding.py: library code (import, export,
    evaluation, tests) needs it without a config, and a config that wants another layout
    sets the key (a tuple of (logical axis, mesh axes) pairs) instead of copying the table.
    """
    return sharding.normalize_rules(config.get("sharding_rules") or sharding.DEFAULT_RULES)


def check_rl_schedule(config) -> None:
    s, kappa = config.staleness, config.publish_every
    if kappa < 1 or s < 0:
        raise ValueError(f"need publish_every >= 1 and staleness >= 0, got {kappa}, {s}")
    if s < kappa - 1:
        raise ValueError(
            f"staleness {s} < publish_every - 1 = {kappa - 1}: the learner would wait for "
            "versions that are never published"
        )


def check_sampling(config) -> None:
    """Refuse sampling settings whose behaviour log-probs the learner cannot reproduce.

    Workers report vLLM's processed log-probs, log softmax(logits / T) of the distribution
    they sampled from, and the RL step divides its logits by the same T (train_step.py), so
    any T > 0 is scored on-policy. Top-p/top-k would make the processed log-probs those of
    a renormalized, truncated distribution that the learner's full softmax does not match
    (importance weights and mismatch/kl silently wrong), so they are refused here; so is
    greedy decoding (T = 0), which has no distribution to correct against.
    """
    r = config.rollout
    t, top_p, top_k = float(r.temperature), float(r.get("top_p", 1.0)), int(r.get("top_k", -1))
    if not (math.isfinite(t) and 0.0 < t <= 100.0):
        raise ValueError(
            f"rollout.temperature={t} is not supported: RL needs sampling from a distribution "
            "(0 < T <= 100); greedy decoding (T=0) has no log-probs to correct against"
        )
    if top_p != 1.0:
        raise ValueError(
            f"rollout.top_p={top_p} is not supported: the learner scores the full tempered "
            "softmax, while top-p samples (and vLLM reports log-probs) from the truncated, "
            "renormalized distribution, so importance weights would be wrong; use top_p=1.0"
        )
    if top_k not in (-1, 0):
        raise ValueError(
            f"rollout.top_k={top_k} is not supported: the learner scores the full tempered "
            "softmax, not the top-k truncated one the worker would sample from; use -1 (off)"
        )


def check_packing(config) -> None:
    """A packed row must hold the longest sequence a batch can have (prompt + answer)."""
    b = config.batch
    width = b.max_prompt_len + b.max_answer_len
    pack_len = b.get("pack_len", 0)
    if b.get("packing", False) and pack_len and pack_len < width:
        raise ValueError(
            f"batch.pack_len={pack_len} < max_prompt_len + max_answer_len = {width}: the "
            "longest sequence would not fit a packed row (0 = that width)"
        )
    d = config.get("distributed", {})
    if b.get("packing", False) and (d.get("num_processes", 0) > 1 or d.get("auto", False)):
        # Each process holds only its own rows of a step (rl/mirror.py), while the packing
        # is computed from every row's length: the processes would pack differently.
        raise ValueError("batch.packing runs on one learner process only (for now)")


def prompt_format(config, task=None) -> PromptFormat:
    """The run's prompt format: config.prompt where it sets a format, else the task's own."""
    p = config.get("prompt")
    if p is None or not p.get("format"):
        if p is not None and (p.get("system") or p.get("thinking")):
            raise ValueError(
                "prompt.system/prompt.thinking are set but prompt.format is '': set "
                "prompt.format='chat' (they only apply to the chat template)"
            )
        return PromptFormat() if task is None else task.prompt_format
    return PromptFormat(kind=p.format, system=p.get("system", ""), thinking=p.get("thinking", ""))


def validate(config) -> None:
    """Every config error that can be found without touching the workdir, raised early."""
    check_batch_sizes(config, make_mesh(config))
    sharding_rules(config)
    check_rl_schedule(config)
    check_sampling(config)
    prompt_format(config)
    check_packing(config)
    for phase in PHASES:
        optimizer_config(config, phase)
        step_config(config, phase)


def make_mesh(config):
    """The config's mesh. Sizes that multiply to fewer than the devices present use the
    first ones (the 1x1x1 default runs anywhere); -1 fills with all devices."""
    shape = {k: int(v) for k, v in config.mesh.items()}
    devices = jax.devices()
    n = math.prod(shape.values())
    if n > 0 and n < len(devices):
        logging.warning("mesh %s uses %d of %d devices", shape, n, len(devices))
        devices = devices[:n]
    return sharding.make_mesh(shape, devices)


def _tiny_config(config) -> ModelConfig:
    m = config.model
    shape = dict(
        num_layers=m.tiny_num_layers,
        hidden_size=m.tiny_hidden_size,
        intermediate_size=m.tiny_intermediate_size,
    )
    if m.get("tiny_tokenizer", "char") == "qwen3":  # Qwen3's tokenizer format + template
        if m.tiny_family != "qwen3":
            raise ValueError("model.tiny_tokenizer='qwen3' needs model.tiny_family='qwen3'")
        return tiny_model.qwen3_config(
            **shape, tie_word_embeddings=not m.get("tiny_never_stop", False)
        )
    return tiny_model.tiny_config(m.tiny_family, **shape)


def check_tiny_model_dir(config, workdir: str) -> None:
    """A workdir's tiny model must be the one the config asks for (resume never mixes shapes).

    Resuming reuses <workdir>/model and its checkpoints; a workdir made by an older or
    different config would otherwise resume a model of another shape, or skip training
    because its step counter is already past the new config's end.
    """
    path = os.path.join(workdir, "model")
    if config.model.hf_dir or not os.path.exists(os.path.join(path, "config.json")):
        return
    have = ModelConfig.from_hf_dir(path)
    want = _tiny_config(config)
    diff = [
        f"{f}: {getattr(have, f)} in the workdir, {getattr(want, f)} in the config"
        for f in ("family", "num_layers", "hidden_size", "intermediate_size")
        if getattr(have, f) != getattr(want, f)
    ]
    if diff:
        raise ValueError(
            f"{workdir} holds a run of a different tiny model ({'; '.join(diff)}); "
            "use a new --workdir (or delete this one) to start over"
        )


def prepare_model_dir(config, workdir: str) -> str:
    """config.model.hf_dir, or a tiny random model written once into <workdir>/model."""
    if config.model.hf_dir:
        return config.model.hf_dir
    check_tiny_model_dir(config, workdir)
    path = os.path.join(workdir, "model")
    # Several processes share the workdir: one writes the model, all read it after.
    if distributed.is_leader() and not os.path.exists(os.path.join(path, "config.json")):
        tiny_model.make_tiny_model(
            path,
            _tiny_config(config),
            seed=config.seed,
            tokenizer=config.model.get("tiny_tokenizer", "char"),
            never_stop=config.model.get("tiny_never_stop", False),
        )
    distributed.barrier(f"tiny_model:{os.path.abspath(path)}")
    return path


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
        opt_cfgs = {p: optimizer_config(config, p) for p in PHASES}
        self.optimizers = {p: optim.make_optimizer(c) for p, c in opt_cfgs.items()}
        self.schedules = {p: optim.make_schedule(c) for p, c in opt_cfgs.items()}
        self.abstract, self.shardings = train_state.state_shardings(
            self.model_cfg, self.optimizers["rl"], self.mesh, self.rules, self.param_dtype
        )
        self.ckpt = checkpoint.Checkpointer(
            checkpoint.checkpoint_dir(workdir),
            checkpoint.CheckpointConfig(
                interval=config.checkpoint.interval,
                keep=config.checkpoint.keep,
                async_save=config.checkpoint.async_save,
            ),
        )
        if jax.process_index() == 0:
            # config + tokenizer beside the checkpoints, so `python -m bridge.export
            # --checkpoint_dir=...` needs nothing else (hf_dir may be elsewhere, or gone).
            hf_export.save_model_files(self.hf_dir, self.ckpt.directory)
        self._steps: dict[str, Any] = {}
        first = "sft" if config.sft.steps > 0 else "rl"
        self.cursor = {"phase": first, "sft_consumed": 0, "rl_start_step": 0, "rl": {}}
        if self.ckpt.latest_step() is not None:
            self.state, self.cursor = self.ckpt.restore(self.abstract)
            logging.info(
                "resumed from step %d (%s)",
                int(self.state.step),
                self.cursor["phase"],
                extra=console.SHOW,
            )
        else:
            _, params = hf_import.load_hf_params(
                self.hf_dir, self.mesh, self.rules, self.param_dtype
            )
            self.state = train_state.state_from_params(
                self.model_cfg,
                params,
                self.optimizers[first],
                self.mesh,
                self.rules,
                config.seed,
                self.param_dtype,
            )
            if first == "rl":
                self.cursor["rl_start_step"] = 0
        # Only process 0 writes metrics lines (every process computes the same numbers).
        self.metrics = MetricsWriter(workdir) if distributed.is_leader() else None
        self._last_line = time.perf_counter()
        self._busy = 0.0
        # Process 0 of a multi-process RL run: announces each step and save to the other
        # processes before running it (learner_jax/rl/mirror.py).
        self.mirror = None

    @property
    def step(self) -> int:
        return int(self.state.step)

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
        self.save(force=True)

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
        self.state, out = fn(self.state, train_step.put_batch(batch, self.mesh, self.rules))
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
            metrics = {**metrics, "learner/utilization": self.utilization()}
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
