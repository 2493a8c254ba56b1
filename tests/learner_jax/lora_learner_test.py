"""A LoRA run of the learner (learner.lora.rank > 0): SFT then RL with packing, only the
adapters in the state, optimizer and checkpoint, the cursor's reference to the base, the
merged policy what is published and evaluated, resume bitwise, and a resume refused when
the base weights changed or the LoRA setting differs."""

import os

import jax
import numpy as np
import pytest
from flax import traverse_util
from safetensors.numpy import load_file, save_file

from bridge.model import layouts
from learner_jax import checkpoint, config_file, lora, lora_state, train, train_step
from learner_jax.learner import Learner

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def lora_config(rank=4):
    c = config_file.load_config(os.path.join(ROOT, "configs", "test_tiny.py"))
    c.learner.lora.rank, c.learner.lora.alpha = rank, 8.0
    c.learner.lora.target_modules = ("q", "v", "o", "down")
    c.sft.steps, c.total_steps = 1, 2
    c.batch.packing = True
    c.checkpoint.interval = 1
    return c


def rl_items(n, rows=8, length=12, vocab=100):
    rng = np.random.default_rng(0)
    for i in range(n):
        tokens = rng.integers(3, vocab, (rows, length + 1))
        mask = np.zeros_like(tokens)
        mask[:, 5:] = 1
        batch = train_step.make_batch(
            tokens,
            mask,
            behavior_logp=-4.8 + 0.1 * rng.standard_normal((rows, length)),
            advantages=rng.standard_normal(rows),
            on_policy=np.ones(rows),
        )
        yield batch, {"policy_version": i, "reward/mean": 0.5}, {"next_prompt": i}


def test_lora_run_trains_only_adapters_and_resumes(tmp_path):
    wd = str(tmp_path)
    learner = train.run(lora_config(), wd, items=rl_items(2))
    assert learner.step == 3 and learner.phase == "rl"
    flat = traverse_util.flatten_dict(jax.device_get(learner.state.params))
    assert flat and all(p[-1] in lora.ADAPTER_LEAVES for p in flat)
    assert {p[2] for p in flat} == {"q_proj", "v_proj", "o_proj", "down_proj"}
    assert jax.tree.structure(learner.state.opt_state[1][0].mu) == jax.tree.structure(
        learner.state.params
    )
    # the published / evaluated policy: the base with the trained adapters merged in
    merged = traverse_util.flatten_dict(jax.device_get(learner.policy_params))
    base = traverse_util.flatten_dict(jax.device_get(learner.state.frozen))
    assert set(merged) == {r.flax_path for r in layouts.table(learner.model_cfg)}
    changed = {p for p in merged if not np.array_equal(merged[p], base[p])}
    assert changed and {p[2] for p in changed} == {"q_proj", "v_proj", "o_proj", "down_proj"}

    ckpt = checkpoint.Checkpointer(checkpoint.checkpoint_dir(wd))
    target = learner.abstract.replace(frozen=learner.state.frozen)
    saved, cursor = ckpt.restore(target)
    ckpt.close()
    ref = cursor[lora_state.CURSOR_KEY]
    assert ref["hf_dir"] == os.path.abspath(learner.hf_dir)
    assert ref["weights_sha256"] == lora_state.weights_digest(learner.hf_dir)
    for a, b in zip(jax.tree.leaves(learner.state), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # resume in the same workdir: the adapters come back bitwise, the base from hf_dir
    again = Learner(lora_config(), wd)
    try:
        for a, b in zip(jax.tree.leaves(learner.state), jax.tree.leaves(again.state), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    finally:
        again.close()

    # a different LoRA setting, or a full-weight config, does not resume these adapters
    for rank in (8, 0):
        with pytest.raises(ValueError, match="learner.lora|LoRA"):
            Learner(lora_config(rank), wd).close()
    # base weights changed under the adapters: refused
    weights = os.path.join(learner.hf_dir, "model.safetensors")
    tensors = load_file(weights)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="not the ones the adapters"):
        Learner(lora_config(), wd).close()


def test_lora_publisher_writes_the_base_once_and_adapter_versions(tmp_path):
    """With LoRA the training binary's publisher (learner_jax/rl/weights.py with the seam's
    AdapterWriter, bridge/weights/adapter.py) writes the frozen base once as version 0 of the main
    store and each version as its PEFT adapter in the adapters/ sub-store, announcing that
    sub-store; the adapter manifest's canary is the merged policy's, and the version read back (what
    the audit re-scores under) is the learner's policy bitwise."""
    from bridge.store.weight_store import WeightStore
    from bridge.weights import adapter_store
    from learner_jax.rl import weights

    learner = Learner(lora_config(), str(tmp_path / "wd"))
    try:
        # trained adapters (lora_b starts at zero: the merged policy would equal the base)
        learner.state = learner.state.replace(
            params=jax.tree.map(lambda x: x + 0.05, learner.state.params)
        )
        store = WeightStore(str(tmp_path / "store"))
        told = []
        pub = weights.WeightPublisher(
            store, lambda v, spec: told.append((v, spec)), learner, every=1, keep=4,
            background=False, seed=0, vocab_size=learner.model_cfg.vocab_size, bos_id=1,
        )  # fmt: skip
        v = learner.step
        pub.publish(v)
        astore = pub.versions_store
        assert told == [(v, astore.spec)] and astore.spec["path"].endswith("/adapters/")
        assert store.versions() == [0] and astore.versions() == [v]
        base = store.manifest(0).extra
        assert base["kind"] == adapter_store.BASE_KIND
        assert base["weights_sha256"] == lora_state.weights_digest(learner.hf_dir)
        m = astore.manifest(v)
        assert m.extra["kind"] == adapter_store.KIND and m.extra["resident"] == 3
        assert m.extra["base"]["version"] == 0
        assert m.extra["canary"] == pub.canary(learner.policy_params)
        assert m.extra["canary"] != base["canary"]  # the adapters change the policy
        assert pub.version_metrics["bridge/version_bytes"] == m.stored_bytes
        assert m.stored_bytes < store.manifest(0).stored_bytes / 5
        got = traverse_util.flatten_dict(jax.device_get(pub.policy_reader()(v)))
        want = traverse_util.flatten_dict(jax.device_get(learner.policy_params))
        assert set(got) == set(want)
        for p in want:
            np.testing.assert_array_equal(got[p], want[p], err_msg=str(p))

        # the next version: the base is not written again
        learner.state = learner.state.replace(step=learner.state.step + 1)
        pub.publish(v + 1)
        assert store.versions() == [0] and astore.versions() == [v, v + 1]

        # a store whose version 0 is not this run's base is refused, nothing published
        other = WeightStore(str(tmp_path / "other"))
        other.publish(0, 0, [("x", np.zeros(2, np.float32))], {}, "float32", {"kind": "x"})
        pub2 = weights.WeightPublisher(
            other, lambda v, spec: told.append((v, spec)), learner, every=1, keep=4,
            background=False, seed=0, vocab_size=learner.model_cfg.vocab_size, bos_id=1,
        )  # fmt: skip
        with pytest.raises(ValueError, match="not this run's LoRA base"):
            pub2.publish(v + 1)
        assert pub2.versions_store.versions() == [] and len(told) == 2
    finally:
        learner.close()
