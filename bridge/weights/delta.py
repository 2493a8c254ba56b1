"""Delta versions: patches on the previous version, with a full anchor now and then.

Writer (learner): `DeltaPublisher` (delta_publisher.py) diffs whole tensors, so one
learner process only; a multi-process learner writes full versions and forgets its base.
Loader (worker): `delta_reconstruct.reconstruct` from the version the engine serves, or
from the anchor when that reads fewer bytes or the worker's copy does not check out, and
only the engine modules whose tensors changed are reloaded. A relay moves a hop's patch
objects and dense tensors, or an anchor whole (bridge/broadcast/chunks.py).
"""

from __future__ import annotations

from bridge.store.manifest import CorruptVersionError
from bridge.weights.delta_publisher import DeltaPublisher
from bridge.weights.delta_reconstruct import reconstruct
from bridge.weights.full import FullVersions, FullWriter
from bridge.weights.sides import EngineSide, LearnerSide

STORE_DRIVERS_ON = ("s3", "gcs")  # "auto": remote stores, where bytes per version decide


class DeltaVersions(FullVersions):
    """The strategy of a version whose manifest carries a patch on its base (`delta`)."""

    def parts(self, manifest, whole: bool | None) -> list[tuple[str, object, bool]]:
        """A hop (`whole` False): each tensor's patch object, or its chunks when dense.
        `whole` (the default for an anchor): every chunk too, for a reader with no copy."""
        whole = manifest.is_full if whole is None else whole
        if whole and not manifest.is_full:
            raise ValueError(
                f"version {manifest.version} is a delta version: it cannot be fetched whole"
            )
        out = []
        for name in manifest.arrays:
            patch = manifest.delta.tensors.get(name)
            stored = patch if patch is not None and patch.kind == "patch" else None
            out.append((name, stored, whole or patch.kind == "dense"))
        return out

    def complete_copy(self, manifest, held: set[str]) -> bool:
        """A hop's plan is every key stored under a delta version; an anchor's only when
        its arrays are held whole too (else it is held as its patch alone)."""
        return not manifest.is_full or held == set(manifest.arrays)

    def load(self, engine: EngineSide, store, version: int, manifest):
        engine.admit_weights(version, manifest)
        tensors, changed = read_for_engine(store, version, engine.held())
        return engine.swap_tensors(version, manifest, tensors, changed)


def read_for_engine(store, version: int, have):
    """(every tensor of `version`, verified; the names that may differ from `have`'s):
    patches on the version served (`have` = (version, tensors), or None), or from the
    anchor when that is cheaper or our copy does not check out."""
    try:
        got = reconstruct(store, version, have=have)
    except CorruptVersionError:
        if have is None:
            raise
        # Our copy is not the store's version of that number (a rerun learner republished
        # it) or is damaged: the anchor path does not use it, and is verified the same way.
        got = reconstruct(store, version)
    return got.tensors, got.changed


class DeltaWriter(FullWriter):
    """Writes each version as a delta on the previous one (`bridge.delta.*`)."""

    def __init__(self, store, anchor_every: int, max_density: float):
        super().__init__(store)
        self.publisher = DeltaPublisher(store, anchor_every, max_density)

    def write(self, side: LearnerSide, version: int, params) -> None:
        if side.processes > 1:  # no process holds a whole tensor to diff: a full version
            super().write(side, version, params)
            self.publisher.forget()  # the next one must not diff against an older one
            return
        params = side.publishable(params)
        extra = {"canary": side.canary(params)}
        sources = side.hf_sources(params)
        self.publisher.publish(version, version, sources, side.hf_config(), side.dtype, extra)

    def metrics(self, version: int) -> dict:
        """`bridge/version_bytes` (a delta's patches, or a full copy) and
        `bridge/delta_density` (fraction of elements changed vs the previous version)."""
        last = self.publisher.last
        if last is not None and last.version == version:
            return {"bridge/version_bytes": last.stored_bytes, "bridge/delta_density": last.density}
        return super().metrics(version)

    def forget(self) -> None:
        """The chain back to an anchor may run through a bad copy: the next is an anchor."""
        self.publisher.forget()


def enabled(delta_config, store) -> bool:
    """`bridge.delta.enabled`: "auto" = on for a remote store (s3, gcs: slow links, where
    bytes per version decide what staleness can hold), off for a local one (a file store on
    this machine reads a full version faster than it rebuilds a chain); "true"/"false" (or
    a bool) force it."""
    value = str(delta_config.enabled).strip().lower()
    if value not in ("auto", "true", "false", "1", "0", "on", "off"):
        raise ValueError(
            f"bridge.delta.enabled must be auto|true|false, got {delta_config.enabled!r}"
        )
    if value == "auto":
        return store.spec["driver"] in STORE_DRIVERS_ON
    return value in ("true", "1", "on")


DELTA = DeltaVersions()
