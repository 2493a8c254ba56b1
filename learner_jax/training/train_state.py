"""The learner's train state (params, optimizer state, step, RNG), built already sharded.

    jax.eval_shape(init)  ->  boxed abstract state (params carry logical axis names)
    sharding.logical_shardings(abstract, mesh, rules)  ->  NamedSharding per leaf
    jax.jit(init, out_shardings=shardings)  ->  every array created directly in its shards

Optimizer-state shardings follow the params' for free: optax builds its moments with
`tree_map` over the boxed params, so mu/nu inherit each parameter's logical names, while
counters (no names) are replicated. The same shardings are the in/out shardings of the
jitted train step and the restore targets of the checkpoint.

Parameters imported from an HF directory (already sharded by `hf_import`) enter through
`state_from_params`, which builds only the optimizer state around them.

With LoRA (`lora`: a `learner_jax.lora.LoraConfig`) `params` holds only the adapters (what
trains, so the optimizer state holds only their moments) and `frozen` the base tree,
sharded by the same rules; without it `frozen` is None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bridge.model.config import ModelConfig
from learner_jax import lora as lora_lib
from learner_jax.model import model, sharding


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 [] optimizer updates applied so far
    params: Any  # Flax parameter tree (bridge/model/layouts.py), param_dtype (fp32 master weights)
    opt_state: Any  # optax state; moments sharded like params
    rng: jax.Array  # uint32 [2] raw PRNG key data, so checkpoints hold a plain array
    frozen: Any = None  # LoRA: the base params (never updated, not checkpointed); else None


def _boxed_state(
    cfg: ModelConfig, optimizer: optax.GradientTransformation, seed, param_dtype, lora=None
):
    params, frozen = model._init_boxed(cfg, jax.random.key(seed), param_dtype, lora), None
    if lora is not None:
        frozen, params = lora_lib.split_params(params)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=optimizer.init(params),
        rng=jax.random.key_data(jax.random.PRNGKey(seed)),  # advanced by fold_in(step)
        frozen=frozen,
    )


def state_shardings(
    cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    rules: Sequence = sharding.DEFAULT_RULES,
    param_dtype=jnp.float32,
    lora=None,
) -> tuple[TrainState, TrainState]:
    """(abstract unboxed state, NamedSharding tree of the same structure)."""
    boxed = jax.eval_shape(lambda: _boxed_state(cfg, optimizer, 0, param_dtype, lora))
    shardings = sharding.logical_shardings(boxed, mesh, rules)
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        nn.unbox(boxed),
        shardings,
    )
    return abstract, shardings


def create_train_state(
    cfg: ModelConfig,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    rules: Sequence = sharding.DEFAULT_RULES,
    seed: int = 0,
    param_dtype=jnp.float32,
    lora=None,
) -> TrainState:
    """A randomly initialized state, created in its shards."""
    _, shardings = state_shardings(cfg, optimizer, mesh, rules, param_dtype, lora)
    init = jax.jit(
        lambda: nn.unbox(_boxed_state(cfg, optimizer, seed, param_dtype, lora)),
        out_shardings=shardings,
    )
    return init()


def state_from_params(
    cfg: ModelConfig,
    params: Any,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    rules: Sequence = sharding.DEFAULT_RULES,
    seed: int = 0,
    param_dtype=jnp.float32,
    lora=None,
) -> TrainState:
    """A state around given parameters (e.g. imported from HF), resharded as the rules say.
    With `lora` the given parameters are the frozen base and fresh adapters (seeded by
    `seed`, peft's init: the policy starts as the base) are what trains."""
    _, shardings = state_shardings(cfg, optimizer, mesh, rules, param_dtype, lora)
    want = jax.tree.structure(shardings.params if lora is None else shardings.frozen)
    if jax.tree.structure(params) != want:
        raise ValueError(f"params do not match the {cfg.family} parameter tree of this config")

    def init(p):
        p, frozen = jax.tree.map(lambda x: x.astype(param_dtype), p), None
        if lora is not None:  # jit drops the unused random base of this init
            boxed = model._init_boxed(cfg, jax.random.key(seed), param_dtype, lora)
            frozen, p = p, lora_lib.split_params(nn.unbox(boxed))[1]
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=p,
            opt_state=optimizer.init(p),
            rng=jax.random.key_data(jax.random.PRNGKey(seed)),
            frozen=frozen,
        )

    return jax.jit(init, out_shardings=shardings)(params)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def spec_tree(state: TrainState):
    """PartitionSpec of every array in a state (for asserting the layout in tests/logs)."""
    return jax.tree.map(lambda x: x.sharding.spec, state)
