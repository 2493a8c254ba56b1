"""The learner's delta publishing: `bridge.delta.*` resolution, and a learner restarted in the
middle of a delta chain resuming with a fresh anchor (real file store, numpy reference)."""

import types

import ml_dtypes
import numpy as np
import pytest

from bridge.store.weight_store import WeightStore
from bridge.weights import kinds
from bridge.weights.delta import DeltaWriter
from bridge.weights.delta_publisher import DeltaPublisher
from bridge.weights.delta_reconstruct import reconstruct
from bridge.weights.full import FullWriter

# `bridge.delta` turning deltas on, with an anchor only at the first version.
DELTA_ON = types.SimpleNamespace(enabled="true", anchor_every=100, max_density=0.5)


def _config(enabled):
    from configs import tiny_arith

    c = tiny_arith.get_config()
    c.bridge.delta.enabled = enabled
    return c


def _writer(config, store):
    """The learner's writer of a full-weight run (no LoRA) under `config.bridge.delta`."""
    return kinds.writer_for(
        store, None, lora=False, delta_config=config.bridge.delta, resident=3, own=True
    )


def test_delta_enabled_auto_is_on_for_remote_stores_only(tmp_path):
    local = WeightStore(str(tmp_path / "w"))
    remote = WeightStore("s3://bucket/run")  # a spec: opens nothing
    assert type(_writer(_config("auto"), local)) is FullWriter
    writer = _writer(_config("auto"), remote)
    assert isinstance(writer, DeltaWriter)
    assert writer.publisher.anchor_every == 16 and writer.publisher.max_density == 0.5
    assert isinstance(_writer(_config("true"), local), DeltaWriter)
    assert type(_writer(_config("false"), remote)) is FullWriter
    with pytest.raises(ValueError, match="auto|true|false"):
        _writer(_config("sometimes"), local)


def _weights(rng, prev=None):
    if prev is None:
        return {n: rng.standard_normal((256, 64)).astype(ml_dtypes.bfloat16) for n in "abc"}
    out = {}
    for n, w in prev.items():
        w = w.copy()
        mask = rng.random(w.shape) < 0.02
        w[mask] = rng.standard_normal(int(mask.sum())).astype(ml_dtypes.bfloat16)
        out[n] = w
    return out


def test_learner_restart_mid_chain_resumes_with_a_fresh_anchor(tmp_path):
    from learner_jax.rl.weights import open_store

    workdir, rng = str(tmp_path / "wd"), np.random.default_rng(0)
    store = open_store("", workdir, step=0)
    pub = DeltaPublisher(store, anchor_every=100, max_density=0.5)
    history = [_weights(rng)]
    for v in range(6):
        if v:
            history.append(_weights(rng, history[-1]))
        pub.publish(v, v, history[v].items(), {}, "bfloat16")
    assert [store.manifest(v).is_full for v in range(6)] == [True] + [False] * 5
    # The learner dies after publishing 5; its last checkpoint is step 3. The rerun's store
    # drops 4 and 5 (they are republished with other weights) and a new publisher starts.
    store = open_store("", workdir, step=3)
    assert store.versions() == [0, 1, 2, 3]
    resumed = DeltaPublisher(store, anchor_every=100, max_density=0.5)
    rerun = _weights(np.random.default_rng(1), history[3])
    resumed.publish(4, 4, rerun.items(), {}, "bfloat16")
    assert store.manifest(4).delta is None and resumed.last.anchor  # a fresh anchor
    resumed.publish(5, 5, _weights(rng, rerun).items(), {}, "bfloat16")
    assert store.manifest(5).delta.base == 4 and not resumed.last.anchor
    # A worker on 3 cannot patch its way to 4 (a plain full version, no patch on 3):
    # it takes the new anchor; its rebuild is bit-exact.
    got = reconstruct(store, 4, have=(3, history[3]))
    assert got.path == [4]
    for n, w in rerun.items():
        assert (got.tensors[n].view(np.uint16) == w.view(np.uint16)).all()


def test_weight_publisher_writes_deltas_of_the_learners_params(tmp_path):
    """The real publish path: a sharded Flax param tree -> whole HF tensors -> a delta on
    the previous version; readers rebuild exactly what a full publish would have stored."""
    import os

    import jax
    import jax.numpy as jnp

    from bridge.model import tiny_model
    from learner_jax import config_file, publish
    from learner_jax.learner import Learner
    from learner_jax.rl.weights import WeightPublisher

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    config = config_file.load_config(os.path.join(root, "configs", "test_tiny.py"))
    config.sft.steps = 0
    learner = Learner(config, str(tmp_path / "wd"))
    try:
        store = WeightStore(str(tmp_path / "store"))
        pub = WeightPublisher(
            store, lambda v, spec: v, learner, every=1, keep=4, background=False, seed=0,
            vocab_size=learner.model_cfg.vocab_size, bos_id=tiny_model.BOS_ID,
            delta_config=DELTA_ON,
        )  # fmt: skip
        params = learner.state.params
        pub.publish(0, params)
        moved = jax.tree.map(
            lambda x: x + (jnp.arange(x.size).reshape(x.shape) % 37 == 0).astype(x.dtype), params
        )
        pub.publish(1, moved)
        m = store.manifest(1)
        assert m.delta is not None and m.delta.base == 0
        assert 0.02 < m.delta.density < 0.04  # 1 in 37 elements moved
        assert pub.version_metrics["bridge/version_bytes"] == m.delta.nbytes < m.total_bytes / 4
        assert pub.version_metrics["bridge/delta_density"] == m.delta.density
        full = WeightStore(str(tmp_path / "full"))
        cfg, dtype = learner.model_cfg, str(learner.publish_dtype)
        full.publish(1, 1, publish.hf_sources(cfg, moved), cfg.to_hf_dict(), dtype)
        want, got = full.read_all(1), store.read_all(1)
        assert set(got) == set(want)
        for n in want:
            assert got[n].tobytes() == want[n].tobytes(), n
    finally:
        learner.close()


def test_a_bf16_run_publishes_bf16_so_small_steps_make_sparse_deltas(tmp_path):
    """fp32 master weights, bf16 compute: versions are stored in bf16 (`bridge.publish_dtype`
    "auto"), the canary scores the rounded weights the workers load, and a small step of the
    masters changes few stored elements. Published in fp32, every moved element would
    change: the delta would be dense and cost a full version."""
    import os

    import jax

    from bridge.model import tiny_model
    from learner_jax import config_file
    from learner_jax.learner import Learner
    from learner_jax.rl.weights import Canary, WeightPublisher

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    config = config_file.load_config(os.path.join(root, "configs", "test_tiny.py"))
    config.sft.steps, config.model.dtype = 0, "bfloat16"
    learner = Learner(config, str(tmp_path / "wd"))
    try:
        assert learner.param_dtype == np.float32 and learner.publish_dtype == ml_dtypes.bfloat16
        store = WeightStore(str(tmp_path / "store"))
        vocab = learner.model_cfg.vocab_size
        pub = WeightPublisher(
            store, lambda v, spec: v, learner, every=1, keep=4, background=False, seed=0,
            vocab_size=vocab, bos_id=tiny_model.BOS_ID,
            delta_config=DELTA_ON,
        )  # fmt: skip
        params = learner.state.params
        pub.publish(0, params)
        assert store.manifest(0).dtype == "bfloat16"
        # A 1e-4 relative step on every master weight: most bf16 roundings stay the same.
        pub.publish(1, jax.tree.map(lambda x: x * (1 + 1e-4), params))
        assert store.manifest(1).delta.density < 0.2
        # The canary is the forward on the bf16-rounded weights, what a worker computes.
        canary = Canary(learner, vocab, tiny_model.BOS_ID, seed=0)
        rounded = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16), params)
        assert store.manifest(0).extra["canary"] == canary(rounded)
        assert store.manifest(0).extra["canary"] != canary(params)
    finally:
        learner.close()
