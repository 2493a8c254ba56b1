"""A LoRA run's versions: the frozen base once, then each version as its adapter alone.

    av = AdapterVersions(store, learner, canary, resident=S + 1, own=True)
    av.write(version, adapters, merged)   # adapter version + the merged policy's canary
    av.store                              # the adapters/ sub-store the fleet is told of

With `learner.lora.rank > 0` the training binary (learner_jax/rl/weights.py) publishes:

- the base, once, as full version `BASE_VERSION` (0) of the run's main store, with
  `extra = {"kind": "lora_base", "weights_sha256", "canary"}`: a worker without a local
  copy builds its engine's model directory from it (rollout_gpu/adapter_swap.py), and checks
  the base canary before serving anything. A resumed run finds it there and checks the
  digest instead of writing it again.
- every version v as a PEFT adapter in the `adapters/` sub-store (bridge/adapters/store.py),
  whose manifest also holds the canary of the merged policy (base + adapters, what a worker
  serving the base with that adapter must score like; same probes and thresholds as full
  versions) and `resident` = S + 1, the adapter versions a worker keeps loaded.

Adapter version numbers are learner steps, like full versions, so staleness, tags and the
controller's bookkeeping are unchanged.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from flax import traverse_util

from bridge.adapters import peft_layout
from bridge.adapters import store as adapter_store
from bridge.store import model_files
from bridge.store.weight_store import WeightStore
from learner_jax import lora_publish, lora_state, publish

BASE_VERSION = 0


class AdapterVersions:
    def __init__(self, store: WeightStore, learner, canary, resident: int, own: bool):
        """`store`: the run's main store; `own`: it is the workdir's (versions newer than the
        checkpoint, a crashed run's, are deleted; in a configured store they are an error,
        as for full versions: weights.open_store)."""
        self.main, self.learner, self.canary = store, learner, canary
        self.resident = max(2, int(resident))
        self.store = adapter_store.adapter_store(store.spec)
        step = learner.step
        newer = [v for v in self.store.versions() if v > step]
        if newer and not own:
            raise ValueError(
                f"adapter store {self.store.spec} has versions {newer} newer than checkpoint "
                f"step {step}: point bridge.store at a fresh path"
            )
        if newer:
            logging.warning("deleting adapter versions %s newer than step %d", newer, step)
            self.store.drop_newer(step)
        model_files.publish(self.store, learner.hf_dir)  # workers start from its spec alone
        self.reference = learner.cursor[lora_state.CURSOR_KEY]
        self._base_checked = False

    def ensure_base(self) -> None:
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
            lrn = self.learner
            frozen = lrn.state.frozen
            extra = {
                "kind": adapter_store.BASE_KIND,
                "weights_sha256": digest,
                "canary": self.canary(frozen),
            }
            publish.publish_params(
                self.main,
                BASE_VERSION,
                BASE_VERSION,
                lrn.model_cfg,
                frozen,
                dtype=str(lrn.param_dtype),
                extra=extra,
            )
        self._base_checked = True

    def write(self, version: int, adapters, merged) -> None:
        """Adapter version `version` of `adapters` (the trained tree), with the canary of
        `merged` (the same policy as full weights)."""
        self.ensure_base()
        lrn = self.learner
        lora_publish.publish_adapter_version(
            self.store,
            version,
            version,
            lrn.model_cfg,
            lrn.lora,
            adapters,
            {**self.reference, "version": BASE_VERSION},
            dtype=str(lrn.param_dtype),
            extra={"canary": self.canary(merged), "resident": self.resident},
        )

    def params(self, version: int):
        """The merged policy of stored adapter version `version` (every chunk verified),
        laid out like the learner's: what the audit re-scores a row tagged `version` under
        (learner_jax/rl/rescore.py)."""
        lrn = self.learner
        stored = peft_layout.from_peft(self.store.read_all(version), lrn.model_cfg)
        like = traverse_util.flatten_dict(dict(lrn.state.params))
        if set(stored) != set(like):
            raise ValueError(f"adapter version {version} has other tensors than the learner's")
        put = lambda p: jax.device_put(np.asarray(stored[p], like[p].dtype), like[p].sharding)
        adapters = traverse_util.unflatten_dict({p: put(p) for p in like})
        return lrn.policy_of(adapters)
