"""JAX edge of the weight bridge: publish a (sharded) Flax param tree to a WeightStore.

Each parameter is written from its addressable shards, one replica of each (replica_id 0),
never gathered onto one device or host: that is what lets a multi-host learner publish.
A shard's block is moved to HF layout by the row's transform and its Flax index is mapped
to the HF index it lands on. The transforms are transposes and reshapes that merge the
(heads, head_dim) axes into one HF axis; a shard whose head_dim range is partial and spans
several heads is not a rectangle in HF layout, so it is cut into one rectangle per head.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from bridge.model import layouts
from bridge.model.config import ModelConfig
from bridge.store.weight_store import Manifest, ShardedSource, WeightStore

Index = tuple[slice, ...]
# (Flax index, Flax block or None, Flax global shape) -> [(HF index, HF block or None)].
# With block=None only the indices are mapped (used for the shard shape in HF layout).
Mapper = Callable[[Index, np.ndarray | None, tuple[int, ...]], list[tuple[Index, Any]]]
MAPPERS: dict[str, Mapper] = {}


def register_mapper(name: str):
    def deco(fn):
        MAPPERS[name] = fn
        return fn

    return deco


def _range(s: slice, n: int) -> tuple[int, int]:
    lo, hi, _ = s.indices(n)
    return lo, hi


def _merged(n: tuple[int, int], h: tuple[int, int], head_dim: int):
    """Ranges on the merged N*H axis covered by n x h, with the local head each comes from."""
    if h == (0, head_dim):
        return [(slice(n[0] * head_dim, n[1] * head_dim), None)]
    return [(slice(i * head_dim + h[0], i * head_dim + h[1]), i - n[0]) for i in range(*n)]


def _pick(block, local, axis):
    """The block restricted to one local head on `axis` (None: all heads, merged)."""
    if block is None or local is None:
        return block
    return np.take(block, [local], axis=axis)


@register_mapper("identity")
def _identity(index, block, shape):
    return [(index, block)]


@register_mapper("linear")
def _linear(index, block, shape):
    return [((index[1], index[0]), None if block is None else block.T)]


@register_mapper("heads_in")
def _heads_in(index, block, shape):
    # Flax [D, N, H] -> HF [N*H, D]
    d, n, h = (_range(s, m) for s, m in zip(index, shape, strict=True))
    out = []
    for rows, local in _merged(n, h, shape[2]):
        b = _pick(block, local, 1)
        if b is not None:
            b = b.reshape(b.shape[0], -1).T  # [D, n*h] -> [n*h, D]
        out.append(((rows, slice(*d)), b))
    return out


@register_mapper("heads_bias")
def _heads_bias(index, block, shape):
    # Flax [N, H] -> HF [N*H]
    n, h = (_range(s, m) for s, m in zip(index, shape, strict=True))
    out = []
    for rows, local in _merged(n, h, shape[1]):
        b = _pick(block, local, 0)
        out.append(((rows,), None if b is None else b.reshape(-1)))
    return out


@register_mapper("heads_out")
def _heads_out(index, block, shape):
    # Flax [N, H, D] -> HF [D, N*H]
    n, h, d = (_range(s, m) for s, m in zip(index, shape, strict=True))
    out = []
    for cols, local in _merged(n, h, shape[1]):
        b = _pick(block, local, 0)
        if b is not None:
            b = b.reshape(-1, b.shape[-1]).T  # [n*h, D] -> [D, n*h]
        out.append(((slice(*d), cols), b))
    return out


def _pieces(arr: jax.Array, mapper: Mapper) -> Iterator[tuple[Index, np.ndarray]]:
    for shard in arr.addressable_shards:
        if shard.replica_id != 0:  # another device (or host) writes this block
            continue
        block = np.asarray(shard.data)  # one shard, on this host
        for hf_index, hf_block in mapper(shard.index, block, arr.shape):
            yield hf_index, np.ascontiguousarray(hf_block)


def _get(tree: Mapping, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree


def hf_sources(cfg: ModelConfig, params: Mapping) -> Iterator[tuple[str, ShardedSource]]:
    """(HF name, ShardedSource) per table row, streaming the addressable shards."""
    hf_shapes = layouts.hf_shapes(cfg)
    for row in layouts.table(cfg):
        arr = _get(params, row.flax_path)
        if not isinstance(arr, jax.Array):
            raise TypeError(f"{'/'.join(row.flax_path)} is {type(arr).__name__}, not a jax.Array")
        mapper = MAPPERS[row.transform.name]
        shard_shape = arr.sharding.shard_shape(arr.shape)
        hf_index, _ = mapper(tuple(slice(0, b) for b in shard_shape), None, arr.shape)[0]
        block_shape = tuple(s.stop - s.start for s in hf_index)
        yield row.hf_name, ShardedSource(hf_shapes[row.hf_name], _pieces(arr, mapper), block_shape)


def publish_params(
    store: WeightStore,
    version: int,
    step: int,
    cfg: ModelConfig,
    params: Mapping,
    dtype: str = "bfloat16",
    extra: Mapping[str, Any] | None = None,
) -> Manifest:
    """Publish a Flax param tree of (possibly sharded) jax.Arrays as HF tensors."""
    return store.publish(version, step, hf_sources(cfg, params), cfg.to_hf_dict(), dtype, extra)
