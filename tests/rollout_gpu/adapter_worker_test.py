"""A rollout worker following a LoRA run, on the real vLLM CPU engine: the announced store
is a LoRA run's `adapters/` sub-store; the worker builds its engine from the base version
in the parent store (every chunk verified, the base's canary checked), then each announced
adapter version goes through its version state machine (WeightVersions.ensure ->
weight_swap.load_version -> adapter_swap): fetched, loaded as a LoRARequest, canary-checked
against the learner's merged-policy log-probs, made the engine's active adapter (its
generations are tagged with it), the newest `resident` (S + 1) kept; a version whose canary
disagrees is refused and the worker keeps generating on the previous adapter."""

import os

import numpy as np
import pytest
from adapters_test import CFG, LORA, learner_logprobs, random_adapters
from safetensors.numpy import save_file

from bridge.adapters import merge
from bridge.contracts import canary as canary_lib
from bridge.control.protocol import VersionAnnouncement, WorkerProfile
from bridge.model import layouts, tiny_model
from bridge.store import model_files
from bridge.store.weight_store import WeightStore
from bridge.weights import adapter_store
from learner_jax import lora_publish
from rollout_gpu.engine import SampleRequest
from rollout_gpu.versions import VersionState

pytestmark = pytest.mark.vllm
_ENGINES = []  # kept alive to the end of the session (conftest: extra_vllm_engine)


def canary(base, adapters):
    """The learner's canary of base + adapters (None: the base alone)."""
    probes = canary_lib.probe_token_lists(CFG.vocab_size, 1, seed=0)
    if adapters is None:
        adapters = jax_zero_adapters()
    return canary_lib.canary_payload(probes, [learner_logprobs(base, adapters, p) for p in probes])


def jax_zero_adapters():
    import jax

    return jax.tree.map(np.zeros_like, random_adapters(0))


def test_worker_follows_adapter_versions(tmp_path):
    from rollout_gpu.adapters import start_lora_engine
    from rollout_gpu.worker import RolloutWorker, WorkerOptions

    base_dir = str(tmp_path / "base")
    tiny_model.make_tiny_model(base_dir, CFG, seed=0)
    weights = tiny_model.random_hf_weights(CFG, 0, std=0.2)
    save_file(weights, os.path.join(base_dir, "model.safetensors"), metadata={"format": "pt"})
    base = layouts.hf_to_flax(CFG, weights)
    digest = merge.weights_digest(base_dir)

    # What the training binary publishes (bridge/weights/adapter.py AdapterWriter).
    main = WeightStore(str(tmp_path / "store"))
    extra = {"kind": adapter_store.BASE_KIND, "weights_sha256": digest}
    main.publish(0, 0, sorted(weights.items()), CFG.to_hf_dict(), "float32",
                 {**extra, "canary": canary(base, None)})  # fmt: skip
    store = adapter_store.adapter_store(main.spec)
    model_files.publish(store, base_dir)
    ref = {"hf_dir": base_dir, "weights_sha256": digest, "version": 0}
    versions = {v: random_adapters(v) for v in (1, 2, 3, 4)}
    for v in (1, 2, 3, 4):
        # version 4's canary is version 1's policy: the worker must refuse it
        lora_publish.publish_adapter_version(
            store, v, v, CFG, LORA, versions[v], ref,
            extra={"canary": canary(base, versions[1 if v == 4 else v]), "resident": 2},
        )  # fmt: skip

    def make_engine(model_dir, lora=None):
        assert lora == {"max_loras": 3, "max_lora_rank": LORA.rank}  # S + 1, and a new one
        _ENGINES.append(start_lora_engine(model_dir, max_model_len=128, **lora))
        return _ENGINES[-1]

    opts = WorkerOptions(
        "http://127.0.0.1:9",  # never called: the test drives the version state itself
        "x",
        WorkerProfile(accelerator="cpu", price_per_hour=0.0, max_concurrent_sequences=8),
        relay=False,
        cache_dir=str(tmp_path / "cache"),
    )
    worker = RolloutWorker(opts, make_engine=make_engine)
    wv = worker.versions
    wv.note(VersionAnnouncement(version=1, store=store.spec, published_at=1.0))
    assert worker.start_engine()  # the LoRA engine on the verified base
    engine = worker.engine
    assert engine.lora_request is None and engine.adapters.keep == 2

    ids = [int(t) for t in np.random.default_rng(0).integers(3, CFG.vocab_size, 24)]
    for v in (1, 2, 3):
        wv.note(VersionAnnouncement(version=v, store=store.spec, published_at=float(v)))
        assert wv.ensure(engine) and wv.state() is VersionState.LOADED and worker.version == v
        assert engine.lora_request.lora_name == f"v{v}"
        [got] = engine.prompt_logprobs([ids])
        want = learner_logprobs(base, versions[v], ids)
        np.testing.assert_allclose(got, want, atol=1e-3, err_msg=f"version {v}")
    assert np.abs(learner_logprobs(base, versions[2], ids) - want).max() > 1e-2
    # the newest S + 1 = 2 resident (vLLM ids are version + 1)
    assert engine.adapters.resident == [2, 3] and engine.adapters.loaded_ids() == {3, 4}
    [[c]] = engine.generate([SampleRequest(ids[:8], max_tokens=4, seed=0)])
    assert len(c.token_ids) == 4

    # a canary mismatch: refused, the previous adapter still serves and is still resident
    wv.note(VersionAnnouncement(version=4, store=store.spec, published_at=4.0))
    assert wv.ensure(engine)  # can take work: on version 3
    assert wv.state() is VersionState.REFUSED and worker.version == 3
    assert engine.lora_request.lora_name == "v3"
    assert engine.adapters.resident == [2, 3] and engine.adapters.loaded_ids() == {3, 4}
    np.testing.assert_allclose(engine.prompt_logprobs([ids])[0], want, atol=1e-3)
    assert 4 in wv.current.bad_versions

    # a rerun learner (crashed after publishing 3, resumed from step 1) publishes 2 again
    # with other adapters: the worker loads the new 2, not its resident copy of the old one
    store.drop_newer(1)
    lora_publish.publish_adapter_version(
        store, 2, 2, CFG, LORA, versions[4], ref,
        extra={"canary": canary(base, versions[4]), "resident": 2},
    )  # fmt: skip
    wv.note(VersionAnnouncement(version=2, store=store.spec, published_at=5.0))
    assert wv.ensure(engine) and wv.state() is VersionState.LOADED and worker.version == 2
    np.testing.assert_allclose(
        engine.prompt_logprobs([ids])[0], learner_logprobs(base, versions[4], ids), atol=1e-3
    )
