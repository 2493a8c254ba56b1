"""A worker without --model_dir: it waits, and never starts vLLM from a store it cannot use."""

import json
import os

import numpy as np

from bridge.control.protocol import VersionAnnouncement, WorkerProfile
from bridge.store import model_files
from bridge.store.weight_store import WeightStore
from rollout_gpu.worker import RolloutWorker, WorkerOptions


def _never(path):
    raise AssertionError(f"vLLM must not start from {path}")


def _worker(tmp_path, make_engine=_never):
    opts = WorkerOptions(
        relay=False,  # no peers here; the flag's default (a relay) is for real fleets
        controller="http://127.0.0.1:9",
        join_secret="x",
        profile=WorkerProfile(accelerator="cpu", price_per_hour=0.0, max_concurrent_sequences=8),
        cache_dir=str(tmp_path / "cache"),
    )
    return RolloutWorker(opts, make_engine=make_engine)


def test_waits_for_a_store_then_refuses_bad_model_files(tmp_path, tiny_model_dir, caplog):
    w = _worker(tmp_path)
    assert not w.start_engine()  # nothing announced yet
    spec = f"file://{tmp_path}/store"
    w.versions.note(VersionAnnouncement(version=3, store=spec))
    assert not w.start_engine()  # a store without model files (e.g. another machine's path)
    assert not w.start_engine()
    said = [r.getMessage() for r in caplog.records if "cannot take the model files" in r.message]
    assert len(said) == 1 and "bridge.store" in said[0]  # once, not at every retry

    store = WeightStore(spec)
    index = model_files.publish(store, tiny_model_dir)
    index["tokenizer.json"]["sha256"] = "0" * 64  # tampered after publishing
    store.kv.write(model_files.INDEX_KEY, json.dumps(index).encode()).result()
    assert not w.start_engine() and w.engine is None


def test_a_full_version_starts_a_plain_engine_on_the_store_model_files(
    tmp_path, tiny_model_dir, vllm_engine
):
    """The announced version's kind picks the engine (bridge/weights/kinds.py): a full
    version gets a plain engine on the store's verified model files (its weights come by
    swap); an adapter version would get a LoRA engine over its base (adapter_worker_test)."""
    spec = f"file://{tmp_path}/store"
    store = WeightStore(spec)
    model_files.publish(store, tiny_model_dir)
    store.publish(3, 3, [("x", np.zeros(2, np.float32))], {}, "float32")
    calls = []

    def make_engine(*args, **kwargs):
        calls.append((args, kwargs))
        return vllm_engine  # the session's engine: nothing is loaded into it here

    w = _worker(tmp_path, make_engine)
    w.versions.note(VersionAnnouncement(version=3, store=spec))
    assert w.start_engine() and w.engine is vllm_engine
    [(args, kwargs)] = calls
    assert kwargs == {} and os.path.isfile(os.path.join(args[0], "config.json"))
    assert args[0].startswith(str(tmp_path / "cache"))


def test_the_peer_rate_floor_reaches_the_workers_relay(tmp_path):
    """`--peer_min_bytes_per_s` is the relay's per-chunk floor (peer_fetch.py): a worker
    built from the options hands it to the relay that fetches from its parent."""
    opts = WorkerOptions(
        relay=True,
        relay_host="127.0.0.1",
        relay_port=0,
        peer_min_bytes_per_s=12_345.0,
        controller="http://127.0.0.1:9",
        join_secret="x",
        profile=WorkerProfile(accelerator="cpu", price_per_hour=0.0, max_concurrent_sequences=8),
        cache_dir=str(tmp_path / "cache"),
    )
    w = RolloutWorker(opts, make_engine=_never)
    try:
        assert w.versions.peers.relay.min_rate == 12_345.0
    finally:
        w.versions.peers.close()
