"""Adapter versions: a LoRA run's frozen base published once, then each version its adapter.

Writer (learner, `AdapterWriter`; a LoRA run has one learner process: run_config.check_lora):

- the base, once, as full version `BASE_VERSION` (0) of the run's main store, with
  `extra = {"kind": "lora_base", "weights_sha256", "canary"}`: a worker without a local
  copy builds its engine's model directory from it (`base_dir`), and checks the base canary
  before serving anything. A resumed run finds it there and checks the digest instead of
  writing it again.
- every version v as a PEFT adapter in the `adapters/` sub-store (adapter_store.py), whose
  manifest also holds the canary of the merged policy (base + adapters, what a worker
  serving the base with that adapter must score like; same probes and thresholds as full
  versions) and `resident` = S + 1, the adapter versions a worker keeps loaded.

Adapter version numbers are learner steps, like full versions, so staleness, tags and the
controller's bookkeeping are unchanged.

Loader (worker): the engine is started once over the base, LoRA-enabled (`engine_recipe`
-> `LoraBase.start` -> `EngineStarter.with_adapters`), and each version is added as a LoRA
request beside the resident ones (`EngineSide.serve_adapter`: rollout_gpu/adapter_swap.py).
An adapter version is stored like a full one (its arrays whole), so the store, the relay
and the readers move it as such.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import tempfile

from bridge.store import model_files
from bridge.store.weight_store import WeightStore
from bridge.weights import adapter_store
from bridge.weights.full import FullVersions, FullWriter
from bridge.weights.sides import EngineSide, EngineStarter, LearnerSide

BASE_VERSION = 0


@dataclasses.dataclass(frozen=True)
class LoraBase:
    model_dir: str  # HF dir: the store's model files + the base weights
    max_rank: int
    resident: int  # adapter versions kept loaded (S + 1, at least 2)
    canary: dict | None
    dtype: str

    def start(self, starter: EngineStarter):
        return starter.with_adapters(self)


class AdapterVersions(FullVersions):
    """The strategy of a version whose manifest says `extra.kind = "lora_adapter"`."""

    def engine_recipe(self, store, manifest, files_dir: str, cache_dir: str) -> LoraBase:
        """A LoRA-enabled engine over the base (written to disk here, once per base)."""
        return base_dir(store, manifest, files_dir, cache_dir)

    def load(self, engine: EngineSide, store, version: int, manifest):
        return engine.serve_adapter(version, manifest, store)


def base_dir(store: WeightStore, manifest, files_dir: str, cache_dir: str) -> LoraBase:
    """The base model directory of an adapter version: the base version (every chunk
    verified, its digest checked against the adapter's reference) written with the store's
    model files as an HF directory, once per base (`<cache_dir>/lora-base-<sha12>`, renamed
    into place)."""
    from safetensors.numpy import save_file

    version, ref = manifest.version, manifest.extra.get("base") or {}
    if "version" not in ref:
        raise ValueError(f"adapter version {version} names no base version in its store")
    parent = adapter_store.base_store(store.spec)
    base = parent.manifest(int(ref["version"]))
    if base.extra.get("kind") != adapter_store.BASE_KIND or base.extra.get(
        "weights_sha256"
    ) != ref.get("weights_sha256"):
        raise ValueError(f"{parent.spec} version {ref['version']} is not the adapter's base")
    out = os.path.join(cache_dir, f"lora-base-{ref['weights_sha256'][:12]}")
    if not os.path.isdir(out):
        tensors = parent.read_all(int(ref["version"]))  # every chunk checked
        os.makedirs(cache_dir, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".lora-base-", dir=cache_dir)
        try:
            for name in os.listdir(files_dir):
                shutil.copy(os.path.join(files_dir, name), tmp)
            save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
            os.chmod(tmp, 0o755)
            os.replace(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    cfg = manifest.extra["adapter_config"]
    return LoraBase(
        out, int(cfg["r"]), max(2, int(manifest.extra.get("resident", 2))),
        base.extra.get("canary"), base.dtype,
    )  # fmt: skip


class AdapterWriter(FullWriter):
    """Writes a LoRA run's versions: `made_of` = (adapters, merged policy)."""

    def __init__(self, store: WeightStore, side: LearnerSide, resident: int, own: bool):
        """`store`: the run's main store; `own`: it is the workdir's (versions newer than the
        checkpoint, a crashed run's, are deleted; in a configured store they are an error,
        as for full versions: learner_jax/rl/weights.open_store)."""
        super().__init__(adapter_store.adapter_store(store.spec))
        self.main = store
        self.resident = max(2, int(resident))
        step = side.step
        newer = [v for v in self.store.versions() if v > step]
        if newer and not own:
            raise ValueError(
                f"adapter store {self.store.spec} has versions {newer} newer than checkpoint "
                f"step {step}: point bridge.store at a fresh path"
            )
        if newer:
            logging.warning("deleting adapter versions %s newer than step %d", newer, step)
            self.store.drop_newer(step)
        model_files.publish(self.store, side.hf_dir)  # workers start from its spec alone
        self.reference = side.lora_reference()
        self._base_checked = False

    def ensure_base(self, side: LearnerSide) -> None:
        """Publish the frozen base as BASE_VERSION of the main store, or check the one there."""
        if self._base_checked:
            return
        digest = self.reference["weights_sha256"]
        if BASE_VERSION in self.main.versions():
            extra = self.main.manifest(BASE_VERSION).extra
            if (
                extra.get("kind") != adapter_store.BASE_KIND
                or extra.get("weights_sha256") != digest
            ):
                raise ValueError(
                    f"{self.main.spec} version {BASE_VERSION} is not this run's LoRA base "
                    f"(sha256 {digest[:12]}): point bridge.store at a fresh path"
                )
        else:
            frozen = side.frozen_params()
            extra = {
                "kind": adapter_store.BASE_KIND,
                "weights_sha256": digest,
                "canary": side.canary(frozen),
            }
            side.publish_full(self.main, BASE_VERSION, frozen, extra, dtype=side.param_dtype)
        self._base_checked = True

    def made_of(self, side: LearnerSide):
        return side.adapter_params(), side.policy_params()

    def write(self, side: LearnerSide, version: int, params) -> None:
        """Adapter version `version` of `adapters` (the trained tree), with the canary of
        `merged` (the same policy as full weights)."""
        adapters, merged = params
        self.ensure_base(side)
        adapter_store.publish_adapter(
            self.store,
            version,
            version,
            side.peft_tensors(adapters),
            side.adapter_config(self.reference.get("hf_dir")),
            side.hf_config(),
            {**self.reference, "version": BASE_VERSION},
            side.param_dtype,
            {"canary": side.canary(merged), "resident": self.resident},
        )

    def policy_reader(self, side: LearnerSide):
        """The merged policy of stored adapter version `version` (every chunk verified),
        laid out like the learner's: what the audit re-scores a row tagged `version` under
        (learner_jax/rl/rescore.py)."""
        return lambda version: side.policy_from_peft(version, self.store.read_all(version))


ADAPTER = AdapterVersions()
