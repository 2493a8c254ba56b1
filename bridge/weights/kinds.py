"""The one place that tells the version kinds apart.

    FULL     every tensor stored whole                               full.py
    DELTA    patches on the previous version, a full anchor now and then   delta.py
    ADAPTER  a LoRA adapter over a base published once                adapter.py

`kind_of(manifest)` reads the manifest fields that say which (`extra["kind"]`, `delta`);
`strategy_of(manifest)` is the strategy that reads, relays, builds an engine for and loads
a version of that kind; `writer_for(...)` is the learner's writer for its run. Nothing
outside bridge/weights/ reads those fields or asks which kind it holds
(tests/bridge/weights/kind_seam_test.py): it calls the strategy.
"""

from __future__ import annotations

import enum

from bridge.weights import adapter_store
from bridge.weights.adapter import ADAPTER, AdapterWriter
from bridge.weights.delta import DELTA, DeltaWriter
from bridge.weights.delta import enabled as delta_enabled
from bridge.weights.full import FULL, FullVersions, FullWriter
from bridge.weights.sides import LearnerSide


class Kind(enum.Enum):
    FULL = "full"
    DELTA = "delta"
    ADAPTER = "adapter"


_STRATEGIES = {Kind.FULL: FULL, Kind.DELTA: DELTA, Kind.ADAPTER: ADAPTER}


def kind_of(manifest) -> Kind:
    """The kind of the version `manifest` describes. An adapter version is stored whole
    (never as a delta), so its marker decides first."""
    if (manifest.extra or {}).get("kind") == adapter_store.KIND:
        return Kind.ADAPTER
    if manifest.delta is not None:
        return Kind.DELTA
    return Kind.FULL


def strategy_of(manifest) -> FullVersions:
    """The strategy of the version `manifest` describes (all share FullVersions' methods)."""
    return _STRATEGIES[kind_of(manifest)]


def writer_for(store, side: LearnerSide, *, lora: bool, delta_config, resident: int, own: bool):
    """The learner's writer: adapters with LoRA (an adapter is already ~1% of the model,
    so never a delta), else deltas when `bridge.delta.*` turns them on, else full versions.
    `resident`: adapter versions a worker keeps loaded (S + 1); `own`: `store` is the
    workdir's (AdapterWriter)."""
    if lora:
        return AdapterWriter(store, side, resident, own)
    if delta_config is not None and delta_enabled(delta_config, store):
        return DeltaWriter(store, int(delta_config.anchor_every), float(delta_config.max_density))
    return FullWriter(store)


def full_writer(store) -> FullWriter:
    """The writer of the processes that follow a multi-process learner's leader: their
    versions are full (no process diffs, and LoRA runs have one process)."""
    return FullWriter(store)
