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
