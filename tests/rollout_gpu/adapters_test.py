"""Adapter versions end to end on the real vLLM CPU engine: the learner publishes LoRA
adapters (PEFT layout) through the adapter sub-store; a LoRA-enabled engine with the base
loaded once takes each version at runtime, keeps the newest `keep` resident (evicting the
oldest from the engine and the disk), and its prompt log-probs under each adapter version
equal the learner's LoRA log-probs (the canary's comparison, per adapter version) within
the full-weight parity tolerance (engine_test.py: 1e-3). A tampered adapter chunk and an
adapter for another base are refused before anything is loaded."""

import os

import jax
import numpy as np
import pytest
from flax import traverse_util
from safetensors.numpy import save_file

from bridge.model import layouts, tiny_model
from bridge.store.manifest import CorruptVersionError
from bridge.weights import adapter_store
from learner_jax import lora, lora_publish, model

pytestmark = pytest.mark.vllm

CFG = tiny_model.tiny_config("qwen3")
LORA = lora.LoraConfig(rank=4, alpha=8.0)
_ENGINES = []  # kept alive to the end of the session (conftest: extra_vllm_engine)


def random_adapters(seed):
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(lambda: model._init_boxed(CFG, jax.random.key(0), np.float32, LORA))
    _, ad = lora.split_params(jax.tree.map(lambda x: x.value, shapes, is_leaf=_boxed))
    flat = traverse_util.flatten_dict(ad)
    return traverse_util.unflatten_dict(
        {p: (0.2 * rng.standard_normal(v.shape)).astype(np.float32) for p, v in flat.items()}
    )


def _boxed(x):
    return hasattr(x, "names") and hasattr(x, "value")


def learner_logprobs(base, adapters, ids):
    tokens = np.asarray([ids[:-1]], np.int32)
    seg = np.ones_like(tokens)
    pos = np.arange(tokens.shape[1], dtype=np.int32)[None]
    targets = np.asarray([ids[1:]], np.int32)
    lp = model.forward_logprobs(
        lora.combine(base, adapters), CFG, tokens, pos, seg, targets, lora=LORA
    )
    return np.asarray(lp[0], np.float64)


def test_adapter_versions_served_by_vllm_match_the_learner(tmp_path):
    from rollout_gpu.adapters import AdapterServer, start_lora_engine

    base_dir = str(tmp_path / "base")
    tiny_model.make_tiny_model(base_dir, CFG, seed=0)
    weights = tiny_model.random_hf_weights(CFG, 0, std=0.2)  # logits O(1)
    save_file(weights, os.path.join(base_dir, "model.safetensors"), metadata={"format": "pt"})
    base = layouts.hf_to_flax(CFG, weights)

    store = adapter_store.adapter_store(str(tmp_path / "store"))
    versions = {v: random_adapters(v) for v in (1, 2, 3)}
    for v, ad in versions.items():
        m = lora_publish.publish_adapter_version(store, v, v, CFG, LORA, ad, {"hf_dir": base_dir})
        assert m.extra["kind"] == adapter_store.KIND
        # rank x (in + out) per projection: a few % of this tiny model's bytes
        assert m.total_bytes == 4 * sum(int(np.prod(x.shape)) for x in jax.tree.leaves(ad))

    engine = start_lora_engine(base_dir, max_loras=2, max_lora_rank=LORA.rank, max_model_len=128)
    _ENGINES.append(engine)
    server = AdapterServer(engine, store, str(tmp_path / "cache"), keep=2)
    ids = [int(t) for t in np.random.default_rng(0).integers(3, CFG.vocab_size, 24)]
    for v in (1, 2, 3):
        [got] = server.prompt_logprobs(v, [ids])
        want = learner_logprobs(base, versions[v], ids)
        np.testing.assert_allclose(got, want, atol=1e-3, err_msg=f"version {v}")
    # the versions really differ from each other by far more than the tolerance
    assert np.abs(learner_logprobs(base, versions[2], ids) - want).max() > 1e-2
    # newest two resident, in the engine and on disk; version 1 evicted from both
    assert server.resident == [2, 3] and server.loaded_ids() == {3, 4}
    assert sorted(os.listdir(tmp_path / "cache")) == ["v2", "v3"]
    # generated tokens carry the adapter version tag
    from vllm import SamplingParams

    [out] = server.generate(3, [ids[:8]], SamplingParams(max_tokens=4, temperature=1.0, seed=0))
    assert out.lora_request.lora_name == "v3" and len(out.outputs[0].token_ids) == 4

    # a tampered chunk of a new version: refused, nothing loaded
    lora_publish.publish_adapter_version(store, 4, 4, CFG, LORA, random_adapters(4))
    name = sorted(store.manifest(4).arrays)[0]
    chunk_dir = os.path.join(tmp_path, "store", "adapters", "data", f"{4:012d}", name, "c")
    chunk = os.path.join(chunk_dir, *sorted(os.listdir(chunk_dir))[:1])
    while os.path.isdir(chunk):
        chunk = os.path.join(chunk, sorted(os.listdir(chunk))[0])
    raw = bytearray(open(chunk, "rb").read())
    raw[-1] ^= 0xFF
    open(chunk, "wb").write(bytes(raw))
    with pytest.raises(CorruptVersionError):
        server.request(4)
    assert server.resident == [2, 3] and not os.path.exists(tmp_path / "cache" / "v4")

    # an adapter published for another base model is refused before loading
    other = tiny_model.tiny_config("qwen3", num_layers=3)
    lora_publish.publish_adapter_version(store, 5, 5, other, LORA, random_adapters(5))
    with pytest.raises(ValueError, match="another base model"):
        server.request(5)
    assert server.resident == [2, 3]
