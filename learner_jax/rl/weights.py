"""Publishing the learner's weights: the store, versions with their canary, every kappa steps.

    store = weights.open_store(config.bridge.store, workdir, learner.step)
    pub = weights.WeightPublisher(store, ctl.publish, learner, ...)
    pub.publish(learner.step)                     # synchronous: workers need a first version
    metrics = pub.after_step(learner.rl_steps)    # publishes every `every` RL steps
    pub.close()

Versions are learner steps (SFT steps included): version v = params after v updates. A
version carries the learner-side canary (log-probs of fixed probe sequences,
`bridge.contracts.canary`) so a worker can check its swap reproduces the learner's model.
With `background=True` (`bridge.async_publish`) `after_step` hands a copy of what a version
is made of to `BackgroundPublisher` and returns at once; the copy is needed because the next
train step donates the state's buffers. The store keeps `keep` versions (S + 2): a worker
may still be reading the oldest one a trajectory is allowed to come from (plus, with delta
versions, the chain back to its anchor: WeightStore.gc). What a version is and how it is
written is its kind's writer (bridge/weights/kinds.py `writer_for`): full, a delta on the
previous one (`bridge.delta.*`), or with LoRA (`learner.lora.rank > 0`; one learner
process: run_config.check_lora) the adapter alone over a base published once, in an
adapter sub-store the fleet is told of. Each publishing step reports
`bridge/version_bytes` and `bridge/delta_density`.

Healing. A version already in the store when it is published (a resumed run's checkpoint
version) is read back and verified first, every chunk against its digest; a corrupt one is
deleted and written again from the params. `republish(v)` answers the workers' report that
they cannot load the newest version v (bridge/control/leasing/liveness.py; the learner asks while it
waits for a batch: learner_jax/rl/heal.py): the learner's current params are published as a
full version (v itself, rewritten if the store's copy does not verify, or the learner's newer
step) and announced again, so workers stalled on it retry.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from bridge.contracts import canary as canary_lib
from bridge.store import model_files
from bridge.store.layout import LAYOUT
from bridge.store.manifest import CorruptVersionError
from bridge.store.weight_store import WeightStore
from bridge.weights import kinds
from learner_jax import model, publish
from learner_jax.background_publish import BackgroundPublisher, PublishError

STORE_DIR = "weights"


def announcing_hash(publish: Callable) -> Callable:
    """`publish(version, spec, manifest_sha256=...)` (the controller's) as an announce
    callback `(version, spec)`: the manifest just written is hashed here, where the store is
    the learner's own, so workers can refuse any other manifest whoever hands it to them."""

    def announce(version: int, spec):
        raw = WeightStore(spec).kv.read(LAYOUT.manifest_key(version)).result().value
        return publish(version, spec, manifest_sha256=hashlib.sha256(raw).hexdigest())

    return announce


def open_store(spec: str, workdir: str, step: int) -> WeightStore:
    """The run's weight store (`spec`, '' = <workdir>/weights) for checkpoint `step`.

    Versions newer than the checkpoint come from a run that died after publishing past its
    last checkpoint; the rerun republishes those numbers with other weights. In the
    workdir's own store they are deleted (the controller rolls back what was sampled from
    them: bridge/control/state/rollback.py); in a configured store they are an error, since a
    shared bucket path may hold someone else's run.
    """
    spec = str(spec or "")
    store = WeightStore(json.loads(spec) if spec.startswith("{") else spec or own_store(workdir))
    newer = [v for v in store.versions() if v > step]
    if not newer:
        return store
    if spec:
        raise ValueError(
            f"weight store {store.spec} has versions {newer} newer than checkpoint step "
            f"{step} (another run, or a lost checkpoint): point bridge.store at a fresh path"
        )
    logging.warning(
        "weight store has versions %s newer than checkpoint step %d (a crashed run's): "
        "deleting them; the rerun publishes those numbers again",
        newer,
        step,
    )
    store.drop_newer(step)
    return store


def own_store(workdir: str) -> str:
    return os.path.join(workdir, STORE_DIR)


class Canary:
    """The learner-side canary of a param tree: log-probs of fixed probe sequences.

    A forward on the sharded params; only the small [probes, T] output is replicated to
    every process, so no process ever holds the whole model (multi-host included).
    """

    def __init__(self, learner, vocab_size: int, bos_id: int, seed: int):
        self._probes = canary_lib.probe_token_lists(vocab_size, bos_id, seed=seed)
        cfg = learner.model_cfg
        self._logprobs = jax.jit(
            lambda p, t, pos, seg, tgt: model.forward_logprobs(p, cfg, t, pos, seg, tgt),
            out_shardings=NamedSharding(learner.mesh, PartitionSpec()),
        )

    def __call__(self, params) -> dict:
        toks = np.asarray(self._probes, np.int32)  # [B, T+1], all probes equal length
        seg = np.ones_like(toks[:, :-1])
        pos = np.broadcast_to(np.arange(toks.shape[1] - 1, dtype=np.int32), seg.shape)
        lps = np.asarray(self._logprobs(params, toks[:, :-1], pos, seg, toks[:, 1:]))
        return canary_lib.canary_payload(self._probes, list(lps))


def write_full_version(store: WeightStore, version: int, learner, canary: Canary) -> None:
    """Write the learner's policy as full version `version` with its canary: what every
    process of a multi-process learner runs together (each writes its own shards)."""
    side = publish.LearnerSide(learner, canary)
    kinds.full_writer(store).write(side, version, side.policy_params())


def sound(store: WeightStore, version: int) -> bool:
    """Whether `version` reads back whole: every array (and, for a delta, its chain to the
    anchor) verified chunk by chunk against the manifest's digests. A corrupt one is deleted
    (with any newer: it is the store's newest when the publisher asks) and False returned."""
    try:
        for _ in store.read(version):
            pass
        return True
    except CorruptVersionError as e:
        logging.warning("version %d in %s is corrupt (%s): writing it again", version, store, e)
    store.drop_newer(version - 1)
    return False


class WeightPublisher:
    """Writes versions of `learner`'s params to `store` and announces them.

    `announce(version, store_spec)` tells the fleet (the controller's `publish`) and returns
    the announcement; `on_announce(announcement)` is told of each one (the swap watcher).
    `mirror`: process 0's `mirror.Leader` in a multi-process run (the others write their
    own shards of each version with it).
    """

    def __init__(
        self,
        store: WeightStore,
        announce: Callable,
        learner,
        *,
        every: int,
        keep: int,
        background: bool,
        seed: int,
        vocab_size: int,
        bos_id: int,
        on_announce: Callable | None = None,
        mirror=None,
        delta_config=None,
        own_store: bool = True,
    ):
        """`delta_config`: `bridge.delta` (None: full versions); `own_store`: `store` is
        the workdir's (a LoRA run's adapter store then drops a crashed run's versions)."""
        self.store, self.announce, self.learner, self.mirror = store, announce, learner, mirror
        self.version_metrics = {}
        self.every, self.keep, self.on_announce = every, keep, on_announce
        # Config + tokenizer beside the versions: a remote worker needs no local model copy.
        model_files.publish(store, learner.hf_dir)
        self.canary = Canary(learner, vocab_size, bos_id, seed)
        self.side = publish.LearnerSide(learner, self.canary)
        self.writer = kinds.writer_for(
            store,
            self.side,
            lora=getattr(learner, "lora", None) is not None,
            delta_config=delta_config,
            resident=keep - 1,
            own=own_store,
        )
        self._background = BackgroundPublisher(self.publish) if background else None
        self._snapshot = jax.jit(lambda p: jax.tree.map(jnp.copy, p))
        self.republished = 0  # versions published again because workers could not load them

    @property
    def versions_store(self) -> WeightStore:
        """The store the fleet is told of (a LoRA run's: its adapter sub-store)."""
        return self.writer.store

    def policy_reader(self):
        """`version -> params` of a stored version for the audit's re-score (a LoRA run's
        merged adapters), or None: the re-score reads full weights from `versions_store`."""
        return self.writer.policy_reader(self.side)

    def publish(self, version: int, params=None) -> float:
        """Write `version` (unless the store has it), announce it, gc; returns seconds.

        `params` defaults to what the learner's current version is made of; the background
        publisher passes its own snapshot (the learner has moved on by then)."""
        t0 = time.perf_counter()
        store = self.writer.store
        if params is None:
            params = self.writer.made_of(self.side)
        write = version not in store.versions() or not sound(store, version)
        if self.mirror is not None:  # the other processes join in
            self.mirror.publish(version, write, store.spec)
        if write:
            self.writer.write(self.side, version, params)
            self.version_metrics = self.writer.metrics(version)
        ann = self.announce(version, store.spec)
        if self.on_announce is not None:
            self.on_announce(ann)
        store.gc(keep=self.keep)
        return time.perf_counter() - t0

    def republish(self, version: int) -> float | None:
        """Workers cannot load `version`, the newest announced: publish the learner's
        current params again as a full version (`version` itself, rewritten if the store's
        copy is corrupt, or the learner's newer step) and announce it. Returns the seconds
        it took, None when the learner is behind `version` (nothing it could publish)."""
        if self._background is not None:
            self._background.flush()  # a version still being written is not the one to heal
        step = self.learner.step
        if step < version:
            logging.error("cannot publish version %d again: the learner is at %d", version, step)
            return None
        self.writer.forget()  # a delta chain back to its anchor may run through the bad copy
        logging.warning(
            "workers cannot load version %d: publishing version %d again from the learner",
            version,
            step,
        )
        self.republished += 1
        return self.publish(step)

    def after_step(self, rl_steps: int) -> dict:
        """Publish the learner's current version if this RL step is a publishing one."""
        out = {"bridge/publish_s": 0.0, "bridge/republished": self.republished}
        if rl_steps % self.every:
            return out
        version = self.learner.step
        if self._background is None:
            out["bridge/publish_s"] = self.publish(version)
            return {**out, **self.version_metrics}
        t0 = time.perf_counter()
        self._background.submit(version, self._snapshot(self.writer.made_of(self.side)))
        out["bridge/publish_blocking_s"] = time.perf_counter() - t0
        out["bridge/publish_s"] = self._background.last_s  # the newest one finished
        out["bridge/publish_skipped"] = self._background.skipped
        return {**out, **self.version_metrics}  # the newest finished version's

    def close(self, timeout: float = 120) -> None:
        """Let the background thread finish what is pending (a failure is logged)."""
        if self._background is not None:
            try:
                self._background.close(timeout=timeout)
            except PublishError as e:
                logging.error("%s", e)
