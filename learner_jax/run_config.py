"""What a config means for the learner: the objects derived from it (optimizers, step
configs, compute dtype, mesh, sharding rules, prompt format) and every check that can fail
before the workdir is touched (`validate`, which the training binary calls first).

One home for these, so the learner (learner_jax/learner.py), the training binary
(learner_jax/train.py) and tests read a config the same way.
"""

from __future__ import annotations

import logging
import math

import jax

from bridge.broadcast.topology import resolve_mode
from bridge.contracts.prompt import PromptFormat
from learner_jax import losses, model, optim, sharding, train_step

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
    resolve_mode(config.bridge.broadcast, "file")  # an unknown mode fails here
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
