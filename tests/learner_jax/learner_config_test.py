"""Config -> learner wiring: phase schedules and the tiny model's shape keys."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "configs"))

import tiny_arith  # noqa: E402

from learner_jax import optim  # noqa: E402
from learner_jax.learner import optimizer_config, prepare_model_dir  # noqa: E402


def test_sft_schedule_has_its_own_end_fraction():
    c = tiny_arith.get_config()
    c.sft.learning_rate, c.sft.steps, c.sft.warmup_steps, c.sft.end_lr_fraction = 1e-3, 100, 10, 1.0
    c.optimizer.learning_rate, c.total_steps, c.optimizer.end_lr_fraction = 1e-4, 50, 0.1
    sft = optim.make_schedule(optimizer_config(c, "sft"))
    rl = optim.make_schedule(optimizer_config(c, "rl"))
    # Constant after warmup in SFT; cosine down to 10% in RL.
    assert [float(sft(s)) for s in (10, 50, 100)] == pytest.approx([1e-3] * 3)
    assert float(rl(50)) == pytest.approx(1e-5)
    del c.sft["end_lr_fraction"]  # older configs: SFT follows optimizer.end_lr_fraction
    assert float(optim.make_schedule(optimizer_config(c, "sft"))(100)) == pytest.approx(1e-4)


def test_tiny_model_shape_comes_from_the_config(tmp_path):
    c = tiny_arith.get_config()
    c.model.tiny_num_layers, c.model.tiny_hidden_size, c.model.tiny_intermediate_size = 3, 96, 160
    path = prepare_model_dir(c, str(tmp_path))
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    assert (hf["num_hidden_layers"], hf["hidden_size"], hf["intermediate_size"]) == (3, 96, 160)


def test_resuming_a_workdir_of_another_tiny_model_is_refused(tmp_path):
    from learner_jax import train

    old = tiny_arith.get_config()
    old.model.tiny_num_layers, old.model.tiny_hidden_size = 2, 64
    prepare_model_dir(old, str(tmp_path))
    before = sorted(os.listdir(tmp_path))
    new = tiny_arith.get_config()  # the demo's 4 x 128
    with pytest.raises(ValueError, match=r"num_layers: 2 in the workdir, 4 in the config"):
        train.run(new, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == before  # refused before writing anything
    prepare_model_dir(old, str(tmp_path))  # the same shape resumes fine


def _publish_small(store, version):
    from bridge.model import tiny_model

    cfg = tiny_model.tiny_config("qwen3", num_layers=1)
    w = tiny_model.random_hf_weights(cfg)
    store.publish(version, version, w.items(), cfg.to_hf_dict(), "float32")


def test_open_store_default_configured_and_stale_versions(tmp_path):
    from bridge.store.weight_store import WeightStore
    from learner_jax.rl_loop import open_store

    c = tiny_arith.get_config()
    wd = str(tmp_path / "wd")
    own = open_store(c, wd, step=0)
    assert own.spec["path"].rstrip("/").endswith("wd/weights")
    _publish_small(own, 5)
    with open(os.path.join(wd, "controller.db"), "w") as f:
        f.write("x")
    # The workdir's own store: versions past the checkpoint are moved aside with the db.
    fresh = open_store(c, wd, step=3)
    assert fresh.versions() == []
    assert sorted(p.split(".stale-")[0] for p in os.listdir(wd) if ".stale-" in p) == [
        "controller.db",
        "weights",
    ]

    # A configured store (URL or JSON kvstore spec) is used as given, and never moved.
    c.bridge.store = f"file://{tmp_path}/shared"
    shared = open_store(c, wd, step=0)
    assert shared.spec["path"].rstrip("/").endswith("shared")
    c.bridge.store = json.dumps({"driver": "file", "path": f"{tmp_path}/shared/"})
    _publish_small(open_store(c, wd, step=0), 7)
    with pytest.raises(ValueError, match=r"versions \[7\] newer than checkpoint step 2"):
        open_store(c, wd, step=2)
    assert WeightStore(f"file://{tmp_path}/shared").versions() == [7]  # untouched
