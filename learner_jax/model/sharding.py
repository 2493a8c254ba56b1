"""Device mesh and the logical-axis rule table that shards the model over it.

The model names only logical axes (`learner_jax/model/model.py`); one rule table, config data
given as a tuple of (logical name, mesh axis or axes or None) pairs, maps them onto the
mesh axes ('data', 'fsdp', 'tensor'). Parameters are built already sharded:
`jax.eval_shape` -> shardings -> `jax.jit(init, out_shardings=...)`.

Departure from flax's plain rule lookup: a dimension whose size the mesh axes do not
divide (e.g. 2 kv heads over tensor=4) is replicated on those axes instead of failing,
so small models run on any mesh; big ones shard as the table says.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from bridge.model.config import ModelConfig
from learner_jax.model import model

MESH_AXES = ("data", "fsdp", "tensor")

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

# The one rule table (a config may set `sharding_rules` to replace it: run_config.sharding_rules).
# The batch is split over data and fsdp (fsdp is data parallelism with sharded weights).
DEFAULT_RULES: Rules = (
    # activations
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    # parameters: FSDP over the model dim, tensor parallel over heads / mlp / vocab.
    # MoE experts split over fsdp (expert parallelism): listed before 'embed' so a stacked
    # expert kernel (expert, embed, mlp) gives fsdp to whole experts, not to the model dim.
    ("expert", "fsdp"),
    ("embed", "fsdp"),
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("kv", None),
)


def normalize_rules(rules: Sequence) -> Rules:
    """Rules from config data (lists from JSON/ConfigDict) as flax's tuple of pairs."""
    out = []
    for pair in rules:
        if len(pair) != 2:
            raise ValueError(f"a sharding rule is a (logical, mesh) pair, got {pair!r}")
        name, axes = pair
        if isinstance(axes, list | tuple):
            axes = tuple(axes)
            bad = [a for a in axes if a not in MESH_AXES]
        else:
            bad = [] if axes is None or axes in MESH_AXES else [axes]
        if bad:
            raise ValueError(f"rule {pair!r} names unknown mesh axes {bad}; known {MESH_AXES}")
        out.append((name, axes))
    return tuple(out)


def make_mesh(shape: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over `devices` (default: all) with axes ('data', 'fsdp', 'tensor').

    `shape` maps axis -> size; missing axes are 1, at most one size may be -1 (fill).
    The product must equal the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; known {MESH_AXES}")
    sizes = [int(shape.get(a, 1)) for a in MESH_AXES]
    if sizes.count(-1) > 1 or any(s == 0 or s < -1 for s in sizes):
        raise ValueError(f"bad mesh shape {dict(shape)}: sizes must be >= 1, one may be -1")
    if -1 in sizes:
        rest = math.prod(s for s in sizes if s != -1)
        if len(devices) % rest:
            raise ValueError(f"mesh shape {dict(shape)} does not divide {len(devices)} devices")
        sizes[sizes.index(-1)] = len(devices) // rest
    if math.prod(sizes) != len(devices):
        named = dict(zip(MESH_AXES, sizes, strict=True))
        raise ValueError(
            f"mesh shape {named} spans {math.prod(sizes)} devices, but {len(devices)} "
            f"{jax.default_backend()} devices are used"
        )
    # Auto axes: the model's logical constraints guide GSPMD; no sharding-in-types.
    return jax.make_mesh(tuple(sizes), MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def _fit(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """Replicate the dims the assigned mesh axes do not divide evenly."""
    dims = list(spec) + [None] * (len(shape) - len(spec))
    for i, axes in enumerate(dims):
        if axes is None:
            continue
        size = math.prod(mesh.shape[a] for a in (axes if isinstance(axes, tuple) else (axes,)))
        if shape[i] % size:
            dims[i] = None
    return PartitionSpec(*dims)


def logical_shardings(abstract_tree, mesh: Mesh, rules: Sequence = DEFAULT_RULES):
    """NamedSharding tree (same structure as the unboxed tree) from a boxed abstract tree."""
    rules = normalize_rules(rules)
    specs = nn.logical_to_mesh(nn.get_partition_spec(abstract_tree), rules)
    shapes = jax.tree.map(
        lambda x: x.value.shape if isinstance(x, nn.LogicallyPartitioned) else np.shape(x),
        abstract_tree,
        is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned),
    )
    return jax.tree.map(
        lambda spec, shape: NamedSharding(mesh, _fit(spec, shape, mesh)),
        specs,
        shapes,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules: Sequence = DEFAULT_RULES):
    return logical_shardings(model.abstract_params(cfg), mesh, rules)


def sharded_init_fn(
    cfg: ModelConfig, mesh: Mesh, rules: Sequence = DEFAULT_RULES, param_dtype=jnp.float32
):
    """jit(rng -> params) whose outputs are created directly in their shards."""
    shardings = param_shardings(cfg, mesh, rules)
    return jax.jit(lambda r: model.init_params(cfg, r, param_dtype), out_shardings=shardings)


def sharded_init(
    cfg: ModelConfig,
    mesh: Mesh,
    rules: Sequence = DEFAULT_RULES,
    rng=None,
    param_dtype=jnp.float32,
):
    """Random parameters, sharded by the rules; no device ever holds the full model."""
    rng = jax.random.key(0) if rng is None else rng
    return sharded_init_fn(cfg, mesh, rules, param_dtype)(rng)


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules: Sequence = DEFAULT_RULES):
    """Context for tracing sharded code: the mesh plus the rules for activation constraints."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(normalize_rules(rules)):
        yield
