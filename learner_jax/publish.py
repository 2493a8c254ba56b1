"""JAX edge of the weight bridge: publish a (sharded) Flax param tree to a WeightStore.

Each parameter is written from its addressable shards, one replica of each (replica_id 0),
never gathered onto one device or host: that is what lets a multi-host learner publish.
Where a shard lands in HF layout, and how its block is converted, is the row's
`layouts.Transform` (`shard_pieces`, `to_hf`): the same object that converts whole arrays,
so the sharded and the gathered paths cannot disagree.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from bridge.model import layouts
from bridge.model.config import ModelConfig
from bridge.store.weight_store import Manifest, ShardedSource, WeightStore


def _pieces(
    arr: jax.Array, transform: layouts.Transform
) -> Iterator[tuple[layouts.Index, np.ndarray]]:
    for shard in arr.addressable_shards:
        if shard.replica_id != 0:  # another device (or host) writes this block
            continue
        block = np.asarray(shard.data)  # one shard, on this host
        for hf_index, local in transform.shard_pieces(shard.index, arr.shape):
            yield hf_index, np.ascontiguousarray(transform.to_hf(block[local]))


def hf_sources(cfg: ModelConfig, params: Mapping) -> Iterator[tuple[str, ShardedSource]]:
    """(HF name, ShardedSource) per table row, streaming the addressable shards."""
    for row in layouts.table(cfg):
        arr = layouts.get_leaf(params, row.flax_path)
        if not isinstance(arr, jax.Array):
            raise TypeError(f"{'/'.join(row.flax_path)} is {type(arr).__name__}, not a jax.Array")
        # The store chunks each array by the HF block of the first shard.
        first = tuple(slice(0, b) for b in arr.sharding.shard_shape(arr.shape))
        hf_index, _ = row.transform.shard_pieces(first, arr.shape)[0]
        block_shape = tuple(s.stop - s.start for s in hf_index)
        yield row.hf_name, ShardedSource(row.hf_shape, _pieces(arr, row.transform), block_shape)


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
