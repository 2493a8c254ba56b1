"""The exact check of rows sampled under a delta version and under a LoRA adapter version,
through the training binary's reader of the published copy (rescore.py
`VersionRescorer.params`; with LoRA `WeightPublisher.policy_reader`) from a real file store.

The rows come from the independent sampler (independent_sampler.py) on the weights a
worker serves: the delta version's own HF tensors, or transformers + peft on the base with
the adapter directory a worker fetches. Honest rows pass; the same rows judged under the
version before (the delta's anchor) or under the base alone are refused, so a reader that
skipped the patch or the adapter would refuse honest workers' rows, and a reader that did
so on both sides would let a worker serve the wrong policy.
"""

import os

import jax
import numpy as np
import pytest
from flax import traverse_util
from independent_sampler import LENGTH, N, group, hf_model, model_dir, peaked_weights, sample

from bridge.control.config import ControllerConfig
from bridge.model import tiny_model
from bridge.store.weight_store import WeightStore
from bridge.weights import adapter_store
from bridge.weights.delta_publisher import DeltaPublisher
from learner_jax import config_file
from learner_jax.rl.exact_check import ExactChecker
from learner_jax.rl.rescore import VersionRescorer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
SEEDS = (21, 22)


def _moved(weights, rng, fraction):
    """`weights` with `fraction` of each tensor's elements moved by N(0, 0.3): a sparse
    step, stored as patches, that still changes which token a seed picks."""
    out = {}
    for name, w in weights.items():
        w = w.copy()
        at = rng.random(w.shape) < fraction
        w[at] += (0.3 * rng.standard_normal(int(at.sum()))).astype(w.dtype)
        out[name] = w
    return out


def _rows(hf, versions):
    """Honest groups (one per seed) sampled by `hf`, every token tagged `versions`."""
    return [
        group(s, s, [sample(hf, s, i) for i in range(N)], versions=[versions] * LENGTH)
        for s in SEEDS
    ]


def _tagged(groups, version):
    """The same rows, claimed to be of `version`."""
    return [
        group(g.group_id, g.sampling_seed, [t.completion_token_ids for t in g.trajectories],
              versions=[version] * LENGTH)
        for g in groups
    ]  # fmt: skip


def test_rows_of_delta_versions_are_checked_under_the_rebuilt_weights(tmp_path):
    """Version 0 full, 1 a patch on 0, 2 a patch on 1 (a chain: the reader must apply
    every patch from the anchor)."""
    cfg = tiny_model.tiny_config("qwen3")
    rng = np.random.default_rng(5)
    history = [peaked_weights()]
    history += [_moved(history[0], rng, 0.05)]
    history += [_moved(history[1], rng, 0.05)]
    store = WeightStore(str(tmp_path / "store"))
    pub = DeltaPublisher(store, anchor_every=100, max_density=0.5)
    for v, w in enumerate(history):
        pub.publish(v, v, w.items(), cfg.to_hf_dict(), "float32")
    assert store.manifest(0).is_full
    for v in (1, 2):
        m = store.manifest(v)
        assert not m.is_full and m.delta.base == v - 1 and m.delta.density < 0.1

    rescorer = VersionRescorer(store, cfg, every=1, max_rows=8)
    checker = ExactChecker(rescorer.params, cfg, temperature=1.0, rows_per_call=8, chunk=8)
    hfs = [hf_model(model_dir(str(tmp_path / f"v{v}"), w)) for v, w in enumerate(history)]
    rows = {v: _rows(hf, v) for v, hf in enumerate(hfs)}
    for v in (1, 2):  # the step moves the samples: a wrong version shows
        assert [t.completion_token_ids for g in rows[v] for t in g.trajectories] != [
            t.completion_token_ids for g in rows[v - 1] for t in g.trajectories
        ]

    verdict = checker.check(rows[0] + rows[1] + rows[2])
    assert verdict.refused == set()
    assert verdict.metrics["exact/checked_tokens"] == 3 * len(SEEDS) * N * LENGTH
    assert sorted(s.version for s in verdict.stats) == [0, 1, 2]
    # the delta versions' rows judged as their base's (a reader that dropped the patch)
    assert checker.check(_tagged(rows[1], 0)).refused == set(SEEDS)
    assert checker.check(_tagged(rows[2], 1)).refused == set(SEEDS)
    assert checker.check(_tagged(rows[1], 2)).refused == set(SEEDS)
    # a swap from 1 to 2 mid-generation: each token checked under the delta it names
    s, head = SEEDS[0], [t.completion_token_ids[:6] for t in rows[1][0].trajectories]
    swapped = [h + sample(hfs[2], s, i, prefix=h)[6:] for i, h in enumerate(head)]
    tags = [1] * 6 + [2] * (LENGTH - 6)
    assert checker.check([group(s, s, swapped, versions=tags)]).refused == set()
    assert checker.check([group(s, s, swapped, versions=[1] * LENGTH)]).refused == {s}


def _lora_config(base_dir):
    c = config_file.load_config(os.path.join(ROOT, "configs", "test_tiny.py"))
    c.model.hf_dir = base_dir
    c.learner.lora.rank, c.learner.lora.alpha = 4, 8.0
    c.learner.lora.target_modules = ("q", "v", "o", "down")
    c.sft.steps = 0
    c.rollout.temperature = 1.0
    return c


def test_rows_of_an_adapter_version_are_checked_under_base_plus_adapter(tmp_path):
    """A LoRA run as the binary publishes it (WeightPublisher: the base as version 0 of the
    main store, each version as its PEFT adapter in adapters/) and checks it
    (VersionRescorer.for_run -> ExactChecker.for_run); the worker serves the base with the
    fetched adapter directory in peft."""
    peft = pytest.importorskip("peft")
    from learner_jax.learner import Learner
    from learner_jax.rl import weights

    base_dir = model_dir(str(tmp_path / "base"), peaked_weights())
    config = _lora_config(base_dir)
    learner = Learner(config, str(tmp_path / "wd"))
    try:
        # trained adapters (lora_b starts at zero: the merged policy would be the base)
        rng = np.random.default_rng(1)
        flat = traverse_util.flatten_dict(dict(learner.state.params))
        moved = {
            p: jax.device_put(
                np.asarray(x) + 0.3 * rng.standard_normal(x.shape).astype(np.float32),
                x.sharding,
            )
            for p, x in flat.items()
        }
        learner.state = learner.state.replace(
            params=traverse_util.unflatten_dict(moved), step=learner.state.step + 1
        )
        version = int(learner.step)
        store = WeightStore(str(tmp_path / "store"))
        pub = weights.WeightPublisher(
            store, lambda v, spec: None, learner, every=1, keep=4, background=False, seed=0,
            vocab_size=learner.model_cfg.vocab_size, bos_id=tiny_model.BOS_ID,
        )  # fmt: skip
        pub.publish(version)
        assert store.versions() == [0] and pub.versions_store.versions() == [version]
        ctl_cfg = ControllerConfig()
        rescorer = VersionRescorer.for_run(config, learner, pub, None, ctl_cfg)
        checker = ExactChecker.for_run(config, rescorer, ctl_cfg)

        # the worker: the base's HF weights with the adapter it fetched, float64 throughout
        adapter_dir = adapter_store.fetch_adapter_dir(
            pub.versions_store, version, str(tmp_path / "adapter")
        )
        base = hf_model(base_dir)
        served = peft.PeftModel.from_pretrained(hf_model(base_dir), adapter_dir).eval()
        rows = _rows(served, version)
        plain = _rows(base, version)
        assert [t.completion_token_ids for g in rows for t in g.trajectories] != [
            t.completion_token_ids for g in plain for t in g.trajectories
        ]  # the adapter moves the samples

        verdict = checker.check(rows)
        assert verdict.refused == set()
        assert verdict.metrics["exact/checked_tokens"] == len(SEEDS) * N * LENGTH
        # the base alone (what the main store holds) refuses the adapter's honest rows...
        as_base = VersionRescorer(store, learner.model_cfg, every=1, max_rows=8)
        base_checker = ExactChecker(
            as_base.params, learner.model_cfg, temperature=1.0, rows_per_call=8, chunk=8
        )
        assert base_checker.check(_tagged(rows, 0)).refused == set(SEEDS)
        # ...and the adapter version refuses rows the base sampled
        assert checker.check(plain).refused == set(SEEDS)
    finally:
        learner.close()
