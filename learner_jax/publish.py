"""JAX edge of the weight bridge: publish a (sharded) Flax param tree to a WeightStore.

Each parameter is written from its addressable shards, one replica of each (replica_id 0),
never gathered onto one device or host: that is what lets a multi-host learner publish.
Where a shard lands in HF layout, and how its block is converted, is the row's
`layouts.Transform` (`shard_pieces`, `to_hf`): the same object that converts whole arrays,
so the sharded and the gathered paths cannot disagree.

`LearnerSide` is what the version strategies (bridge/weights/) call on the learner: these
publishes, the canary, and with LoRA the adapters as PEFT tensors (lora_publish.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from bridge.model import layouts
from bridge.model.config import ModelConfig
from bridge.store import sharded_publish
from bridge.store.weight_store import Manifest, ShardedSource, WeightStore
from learner_jax import lora_publish, lora_state
from learner_jax.multihost import distributed


def _writers(arr: jax.Array) -> set[jax.Device]:
    """The one device whose copy of each distinct shard is written, spread over processes.

    Every process computes the same answer from the global sharding. Replica 0 of a block
    replicated over the data axis would put every write on the first data row's process;
    taking the k-th distinct block's k-th holder (mod holders) shares the writes among
    the processes that hold copies.
    """
    holders: dict[tuple, list[jax.Device]] = {}
    for device, index in arr.sharding.devices_indices_map(arr.shape).items():
        key = tuple(s.indices(n) for s, n in zip(index, arr.shape, strict=True))
        holders.setdefault(key, []).append(device)
    return {
        sorted(devs, key=lambda d: d.id)[k % len(devs)]
        for k, (_, devs) in enumerate(sorted(holders.items()))
    }


def _pieces(
    arr: jax.Array, transform: layouts.Transform
) -> Iterator[tuple[layouts.Index, np.ndarray]]:
    writers = _writers(arr) if jax.process_count() > 1 else None
    for shard in arr.addressable_shards:
        if writers is not None:
            if shard.device not in writers:  # another device (or host) writes this block
                continue
        elif shard.replica_id != 0:  # another device writes this block
            continue
        pieces = transform.shard_pieces(shard.index, arr.shape)
        if transform.expert is not None:
            # One expert of a stacked leaf: slice it on the device, so publishing E experts
            # moves each shard to the host once in total, not once per expert.
            for hf_index, local in pieces:
                yield hf_index, np.ascontiguousarray(transform.to_hf(np.asarray(shard.data[local])))
            continue
        block = np.asarray(shard.data)  # one shard, on this host
        for hf_index, local in pieces:
            yield hf_index, np.ascontiguousarray(transform.to_hf(block[local]))


def hf_sources(cfg: ModelConfig, params: Mapping) -> Iterator[tuple[str, ShardedSource]]:
    """(HF name, ShardedSource) per table row, streaming the addressable shards."""
    for row in layouts.table(cfg):
        arr = layouts.get_leaf(params, row.flax_path)
        if not isinstance(arr, jax.Array):
            raise TypeError(f"{'/'.join(row.flax_path)} is {type(arr).__name__}, not a jax.Array")
        # The store chunks each array by the HF block of the first shard (for an expert
        # row, the first shard that holds its expert).
        block = arr.sharding.shard_shape(arr.shape)
        first = tuple(slice(0, b) for b in block)
        if row.transform.expert is not None:
            lo = row.transform.expert // block[0] * block[0]
            first = (slice(lo, lo + block[0]), *first[1:])
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
    """Publish a Flax param tree of (possibly sharded) jax.Arrays as HF tensors.

    Across processes every process must call this (same arguments): each writes its own
    shards, process 0 writes the manifest after all have written (`publish_multiprocess`).
    """
    if jax.process_count() > 1:
        return publish_multiprocess(store, version, step, cfg, params, dtype, extra)[0]
    return store.publish(version, step, hf_sources(cfg, params), cfg.to_hf_dict(), dtype, extra)


def publish_multiprocess(
    store: WeightStore,
    version: int,
    step: int,
    cfg: ModelConfig,
    params: Mapping,
    dtype: str = "bfloat16",
    extra: Mapping[str, Any] | None = None,
) -> tuple[Manifest, dict[str, list[list[int]]]]:
    """(manifest, chunk positions this process wrote), via bridge/store/sharded_publish.py.

    The barriers are the coordination service's, safe from the background publisher's
    thread; a process that dies mid-publish stops the others at the next barrier (heartbeat
    timeout), and no manifest is written, so readers never see the torn version.
    """
    sources = list(hf_sources(cfg, params))
    tag = f"publish:{sorted(store.spec.items())}:{version}"
    lead = jax.process_index() == 0
    if lead:
        layout = {n: (tuple(s.shape), s.block_shape) for n, s in sources}
        sharded_publish.begin(store, version, layout, dtype)
    distributed.barrier(f"{tag}:begin")
    written = sharded_publish.write_part(store, version, jax.process_index(), sources, dtype)
    distributed.barrier(f"{tag}:written")
    if lead:
        sharded_publish.commit(
            store, version, step, jax.process_count(), cfg.to_hf_dict(), dtype, extra
        )
    distributed.barrier(f"{tag}:committed")
    return store.manifest(version), written


class LearnerSide:
    """The learner's half of every version kind (bridge/weights/sides.py `LearnerSide`):
    `learner` a Learner, `canary` its params -> canary payload (learner_jax/rl/weights.py)."""

    def __init__(self, learner, canary):
        self.learner, self.canary = learner, canary
        self.dtype = str(learner.publish_dtype)
        self.param_dtype = str(learner.param_dtype)
        self.hf_dir = learner.hf_dir

    @property
    def processes(self) -> int:
        return jax.process_count()

    @property
    def step(self) -> int:
        return self.learner.step

    def hf_config(self) -> dict:
        return self.learner.model_cfg.to_hf_dict()

    def policy_params(self):
        return self.learner.policy_params

    def publishable(self, params):
        """`params` in the stored dtype: the canary scores what workers load."""
        lrn = self.learner
        if lrn.publish_dtype == lrn.param_dtype:
            return params
        return jax.tree.map(lambda x: x.astype(lrn.publish_dtype), params)

    def hf_sources(self, params):
        return hf_sources(self.learner.model_cfg, params)

    def publish_full(self, store, version: int, params, extra, dtype: str = "") -> Manifest:
        cfg = self.learner.model_cfg
        dtype = dtype or self.dtype
        return publish_params(store, version, version, cfg, params, dtype=dtype, extra=extra)

    # LoRA
    def lora_reference(self) -> dict:
        return self.learner.cursor[lora_state.CURSOR_KEY]

    def adapter_params(self):
        return self.learner.state.params

    def frozen_params(self):
        return self.learner.state.frozen

    def peft_tensors(self, adapters) -> dict[str, np.ndarray]:
        return lora_publish.peft_tensors(adapters)

    def adapter_config(self, base_model: str | None) -> dict:
        return lora_publish.adapter_config(self.learner.lora, base_model)

    def policy_from_peft(self, version: int, tensors: Mapping[str, np.ndarray]):
        return lora_publish.policy_from_peft(self.learner, version, tensors)
