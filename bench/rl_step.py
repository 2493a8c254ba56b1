"""The RL train step the learner benches run: a random-weight policy, its jitted GRPO step
(learner_jax/training/train_step.py) and random token rows (a quarter prompt, the rest completion).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from bridge.model.config import ModelConfig
from learner_jax.model import model
from learner_jax.training import losses, optim, train_state, train_step


def optimizer():
    return optim.make_optimizer(
        optim.OptimizerConfig(learning_rate=1e-6, warmup_steps=0, total_steps=100)
    )


def build(
    cfg: ModelConfig,
    mesh,
    dtype: str = "float32",
    options: model.ModelOptions | None = None,
    micro_batches: int = 1,
    param_dtype: str = "float32",
    sampling_check: bool = True,
    seed: int = 0,
):
    """(state, jitted step) for one RL step with AdamW on fresh random parameters."""
    pdt = jnp.dtype(param_dtype)
    state = train_state.create_train_state(cfg, optimizer(), mesh, seed=seed, param_dtype=pdt)
    step = jit_step(cfg, mesh, dtype, options, micro_batches, param_dtype, sampling_check)
    return state, step


def jit_step(
    cfg: ModelConfig,
    mesh,
    dtype: str = "float32",
    options: model.ModelOptions | None = None,
    micro_batches: int = 1,
    param_dtype: str = "float32",
    sampling_check: bool = True,
):
    """The jitted RL step alone, for a state `build` made (another attention, say)."""
    opt = optimizer()
    _, shardings = train_state.state_shardings(cfg, opt, mesh, param_dtype=jnp.dtype(param_dtype))
    step_cfg = train_step.StepConfig(
        kind="rl",
        loss=losses.LossConfig(name="grpo"),
        micro_batches=micro_batches,
        dtype=dtype,
        model_options=options or model.ModelOptions(),
        sampling_check=sampling_check,
    )
    return train_step.jit_step(cfg, opt, step_cfg, mesh, shardings)


def random_batch(
    cfg: ModelConfig, rows: int, seq_len: int, rng: np.random.Generator, on_policy=None
) -> train_step.Batch:
    """Host rows of `seq_len` random tokens, behaviour log-probs near a uniform policy's."""
    tokens = rng.integers(3, cfg.vocab_size, (rows, seq_len + 1))
    loss_mask = np.zeros_like(tokens)
    loss_mask[:, seq_len // 4 :] = 1  # a quarter prompt, the rest completion
    return train_step.make_batch(
        tokens,
        loss_mask,
        valid=np.ones_like(tokens, bool),
        behavior_logp=-12.0 + rng.standard_normal((rows, seq_len)),
        advantages=rng.standard_normal(rows),
        on_policy=on_policy,
    )
