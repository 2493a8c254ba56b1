"""The run's weight store: the workdir's own, a configured one, and versions past the
checkpoint."""

import json
import os

import pytest


def _publish_small(store, version):
    from bridge.model import tiny_model

    cfg = tiny_model.tiny_config("qwen3", num_layers=1)
    w = tiny_model.random_hf_weights(cfg)
    store.publish(version, version, w.items(), cfg.to_hf_dict(), "float32")


def test_open_store_default_configured_and_stale_versions(tmp_path):
    from bridge.store.weight_store import WeightStore
    from learner_jax.rl.weights import open_store

    spec = ""  # config.bridge.store's default: the workdir's own store
    wd = str(tmp_path / "wd")
    own = open_store(spec, wd, step=0)
    assert own.spec["path"].rstrip("/").endswith("wd/weights")
    for v in (2, 3, 4, 5):
        _publish_small(own, v)
    with open(os.path.join(wd, "controller.db"), "w") as f:
        f.write("x")
    # The workdir's own store: only the versions past the checkpoint are deleted (with
    # their data: publishing 4 again must not meet the crashed run's chunks); the database
    # stays (the controller rolls back what those versions sampled).
    resumed = open_store(spec, wd, step=3)
    assert resumed.versions() == [2, 3]
    assert not [p for p in os.listdir(wd) if ".stale-" in p]
    assert open(os.path.join(wd, "controller.db")).read() == "x"
    data = os.listdir(os.path.join(wd, "weights", "data"))
    assert sorted(data) == ["000000000002", "000000000003"], data
    _publish_small(resumed, 4)
    assert resumed.versions() == [2, 3, 4] and len(resumed.read_all(4)) > 0

    # A configured store (URL or JSON kvstore spec) is used as given, and never moved.
    spec = f"file://{tmp_path}/shared"
    shared = open_store(spec, wd, step=0)
    assert shared.spec["path"].rstrip("/").endswith("shared")
    spec = json.dumps({"driver": "file", "path": f"{tmp_path}/shared/"})
    _publish_small(open_store(spec, wd, step=0), 7)
    with pytest.raises(ValueError, match=r"versions \[7\] newer than checkpoint step 2"):
        open_store(spec, wd, step=2)
    assert WeightStore(f"file://{tmp_path}/shared").versions() == [7]  # untouched


def test_the_announcement_carries_the_manifest_hash(tmp_path):
    """What the learner announces names the manifest it wrote, so workers can refuse any
    other (the controller cannot read a remote store's manifest itself without stalling)."""
    from bridge.broadcast.chunks import manifest_sha256
    from bridge.control.config import ControllerConfig
    from bridge.control.controller import Controller
    from bridge.store.layout import LAYOUT
    from bridge.store.weight_store import WeightStore
    from bridge.tasks import make_task
    from learner_jax.rl.weights import announcing_hash

    store = WeightStore(f"memory://announce-{os.getpid()}")  # the controller cannot read it
    _publish_small(store, 3)
    want = manifest_sha256(store.kv.read(LAYOUT.manifest_key(3)).result().value)
    ctl = Controller(ControllerConfig(), str(tmp_path / "c.db"), make_task("arithmetic"))
    try:
        assert ctl.publish(3, store.spec).manifest_sha256 is None
        assert announcing_hash(ctl.publish)(3, store.spec).manifest_sha256 == want
        assert ctl.announcement().manifest_sha256 == want
    finally:
        ctl.close()
