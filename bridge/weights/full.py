"""Full versions: every tensor stored whole under its version number.

Writer (learner): the learner's params in HF layout, streamed shard by shard
(`LearnerSide.publish_full`: across processes each writes its own shards), with the canary
of what workers will load. Loader (worker): every array read and verified, then all of
them reloaded. The delta and adapter kinds build on these two halves.
"""

from __future__ import annotations

import dataclasses

from bridge.weights.sides import EngineSide, EngineStarter, LearnerSide


@dataclasses.dataclass(frozen=True)
class PlainEngine:
    model_dir: str

    def start(self, starter: EngineStarter):
        return starter.plain(self.model_dir)


class FullVersions:
    """The strategy of a version whose manifest has no patch and no adapter marker.

    Reading one is `WeightStore.read` (delta_reconstruct.read_version: stored whole)."""

    # -- relay -------------------------------------------------------------------------
    def parts(self, manifest, whole: bool | None) -> list[tuple[str, object, bool]]:
        """What a relay moves: (tensor, its patch or None, its chunks too); a full version
        is its arrays' chunks, nothing else."""
        if whole is False:
            raise ValueError(f"version {manifest.version} is a full version without a patch")
        return [(name, None, True) for name in manifest.arrays]

    def complete_copy(self, manifest, held: set[str]) -> bool:
        """Whether a relay holding the chunks of `held` holds every key of the version."""
        return held == set(manifest.arrays)

    # -- worker ------------------------------------------------------------------------
    def engine_recipe(self, store, manifest, files_dir: str, cache_dir: str) -> PlainEngine:
        """How a worker builds the engine that serves this version: on the store's model
        files (`files_dir`), loaded with the version's weights afterwards."""
        return PlainEngine(files_dir)

    def load(self, engine: EngineSide, store, version: int, manifest):
        """Read, verify and swap in `version` (the engine side checks it first)."""
        engine.admit_weights(version, manifest)
        return engine.swap_tensors(version, manifest, store.read_all(version), None)


class FullWriter:
    """Writes full versions of the learner's policy to `store`."""

    def __init__(self, store):
        self.store = store

    def made_of(self, side: LearnerSide):
        """What a version is made of: the policy params."""
        return side.policy_params()

    def write(self, side: LearnerSide, version: int, params) -> None:
        params = side.publishable(params)
        side.publish_full(self.store, version, params, {"canary": side.canary(params)})

    def metrics(self, version: int) -> dict:
        """`bridge/version_bytes` (what the version added to the store) and
        `bridge/delta_density` (1.0: not compared with the previous version)."""
        nbytes = self.store.manifest(version).stored_bytes
        return {"bridge/version_bytes": nbytes, "bridge/delta_density": 1.0}

    def forget(self) -> None:
        """Nothing is remembered between full versions."""

    def policy_reader(self, side: LearnerSide):
        """`version -> params` for the audit's re-score, None: it reads full weights itself."""
        return None


FULL = FullVersions()
