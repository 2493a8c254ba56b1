"""Config -> learner wiring: phase schedules and the tiny model's shape keys."""

import json
import os

import pytest

from learner_jax import config_file, train
from learner_jax.model.model_dir import prepare_model_dir
from learner_jax.run_config import optimizer_config
from learner_jax.training import optim

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "tiny_arith.py")


def tiny_arith():
    return config_file.load_config(CONFIG)


def test_sft_schedule_has_its_own_end_fraction():
    c = tiny_arith()
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
    c = tiny_arith()
    c.model.tiny_num_layers, c.model.tiny_hidden_size, c.model.tiny_intermediate_size = 3, 96, 160
    path = prepare_model_dir(c, str(tmp_path))
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    assert (hf["num_hidden_layers"], hf["hidden_size"], hf["intermediate_size"]) == (3, 96, 160)


def test_resuming_a_workdir_of_another_tiny_model_is_refused(tmp_path):
    old = tiny_arith()
    old.model.tiny_num_layers, old.model.tiny_hidden_size = 2, 64
    prepare_model_dir(old, str(tmp_path))
    before = sorted(os.listdir(tmp_path))
    new = tiny_arith()  # the demo's 4 x 128
    with pytest.raises(ValueError, match=r"num_layers: 2 in the workdir, 4 in the config"):
        train.run(new, str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == before  # refused before writing anything
    prepare_model_dir(old, str(tmp_path))  # the same shape resumes fine


def test_sharding_rules_default_and_override():
    from learner_jax.model import sharding
    from learner_jax.run_config import sharding_rules, validate

    c = tiny_arith()
    assert "sharding_rules" not in c  # the table lives in learner_jax/model/sharding.py only
    assert sharding_rules(c) == sharding.DEFAULT_RULES
    c.sharding_rules = [["batch", ["data", "fsdp"]], ["embed", None]]
    assert sharding_rules(c) == (("batch", ("data", "fsdp")), ("embed", None))
    c.sharding_rules = [["batch", "nope"]]
    with pytest.raises(ValueError, match="unknown mesh axes"):
        validate(c)


def test_rl_schedule_checked_before_anything_runs():
    from learner_jax.run_config import validate

    c = tiny_arith()
    c.staleness, c.publish_every = 0, 2
    with pytest.raises(ValueError, match="staleness 0 < publish_every - 1 = 1"):
        validate(c)
    c.staleness, c.publish_every = 2, 0
    with pytest.raises(ValueError, match="publish_every >= 1"):
        validate(c)


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("top_p", 0.0, r"rollout.top_p=0.0 is not supported.*\(0, 1\]"),
        ("top_p", 1.5, r"rollout.top_p=1.5 is not supported"),
        ("top_k", 1, r"rollout.top_k=1 is not supported.*greedy"),
        ("top_k", -2, r"rollout.top_k=-2 is not supported"),
        ("min_p", 1.0, r"rollout.min_p=1.0 is not supported.*greedy"),
        ("temperature", 0.0, r"rollout.temperature=0.0 is not supported.*greedy"),
    ],
)
def test_sampling_the_learner_cannot_score_is_refused(key, value, match):
    from learner_jax.run_config import validate

    c = tiny_arith()
    c.rollout.temperature = 0.7  # below 1 is fine: the learner scores logits / T
    # truncation too: the learner applies the sampler's (learner_jax/model/truncation.py)
    c.rollout.top_p, c.rollout.top_k, c.rollout.min_p = 0.9, 20, 0.05
    validate(c)
    setattr(c.rollout, key, value)
    with pytest.raises(ValueError, match=match):
        validate(c)


def test_rl_step_config_carries_the_sampling_temperature():
    from learner_jax.model.truncation import Truncation
    from learner_jax.run_config import step_config

    c = tiny_arith()
    c.rollout.temperature = 0.6
    assert step_config(c, "rl").temperature == 0.6
    assert step_config(c, "sft").temperature == 1.0  # SFT trains the model itself
    c.rollout.top_p, c.rollout.top_k, c.rollout.min_p = 0.9, 20, 0.05
    assert step_config(c, "rl").truncation == Truncation(top_p=0.9, top_k=20, min_p=0.05)


def test_task_thinking_sets_enable_thinking_on_the_chat_format():
    from bridge.contracts.prompt import PromptFormat
    from learner_jax.run_config import prompt_format

    c = tiny_arith()
    c.task.thinking = "auto"  # the template's default: nothing set
    assert prompt_format(c) == PromptFormat()
    c.task.thinking = "on"
    with pytest.raises(ValueError, match="task.thinking='on' needs the chat format"):
        prompt_format(c)
    c.prompt.format = "chat"
    assert prompt_format(c) == PromptFormat("chat", thinking="on")
    c.task.thinking = "sometimes"
    with pytest.raises(ValueError, match="task.thinking must be one of"):
        prompt_format(c)


def test_prompt_format_from_config_or_task():
    from bridge.contracts.prompt import PromptFormat
    from learner_jax.run_config import prompt_format, validate

    class ChatTask:
        prompt_format = PromptFormat("chat", thinking="off")

    c = tiny_arith()
    assert (
        prompt_format(c) == PromptFormat() and prompt_format(c, ChatTask) == ChatTask.prompt_format
    )
    c.prompt.format, c.prompt.system = "chat", "Be brief."
    assert prompt_format(c, ChatTask) == PromptFormat("chat", system="Be brief.")
    c.prompt.format = "plain"  # a system prompt needs the chat template
    with pytest.raises(ValueError, match="need the chat format"):
        validate(c)
    c.prompt.format, c.prompt.system, c.prompt.thinking = "", "", "off"
    with pytest.raises(ValueError, match="prompt.format is ''"):
        validate(c)
    c.prompt.format, c.prompt.thinking = "markdown", ""
    with pytest.raises(ValueError, match="prompt format must be one of"):
        validate(c)


def test_real_models_compute_in_bf16_over_fp32_master_weights():
    from learner_jax.run_config import compute_dtype, step_config, validate

    c = tiny_arith()
    assert c.model.param_dtype == "float32"  # master weights, whatever the compute dtype
    assert compute_dtype(c) == "float32"  # the tiny model: exact CPU parity by default
    c.model.hf_dir = "/models/Qwen3-0.6B"
    assert compute_dtype(c) == "bfloat16" and step_config(c, "rl").dtype == "bfloat16"
    c.model.dtype = "float32"  # an explicit choice wins
    assert compute_dtype(c) == "float32"
    c.model.dtype = "fp8"
    with pytest.raises(ValueError, match="model.dtype must be"):
        validate(c)


def test_packing_config_is_checked():
    from learner_jax.run_config import validate

    c = tiny_arith()
    c.batch.packing, c.batch.pack_len = True, 0
    validate(c)  # 0 = the row width
    c.batch.pack_len = 10
    with pytest.raises(ValueError, match=r"pack_len=10 < max_prompt_len \+ max_answer_len = 24"):
        validate(c)
    c.batch.pack_len = 0
    c.distributed.num_processes = 2
    with pytest.raises(ValueError, match="packing runs on one learner process only"):
        validate(c)


def test_lora_across_learner_processes_is_refused():
    """Adapter versions are published by one process: LoRA with several is refused at
    validation, with what to do instead (not silently published as merged weights)."""
    from learner_jax.run_config import validate

    c = tiny_arith()
    c.learner.lora.rank = 16
    validate(c)  # one process
    c.distributed.num_processes = 2
    with pytest.raises(ValueError, match="learner.lora.rank > 0 runs on one learner process"):
        validate(c)
    c.distributed.num_processes, c.distributed.auto = 0, True
    with pytest.raises(ValueError, match="learner.lora.rank > 0 runs on one learner process"):
        validate(c)


def test_broadcast_auto_follows_the_store_and_a_bad_mode_fails_validation():
    from learner_jax.run_config import broadcast_mode, validate

    c = tiny_arith()
    assert c.bridge.broadcast == "auto" and broadcast_mode(c) == "store"  # <workdir>/weights
    c.bridge.store = "s3://bucket/runs/r1"
    assert broadcast_mode(c) == "chain"
    c.bridge.store = '{"driver": "memory", "path": "x/"}'
    assert broadcast_mode(c) == "store"
    c.bridge.broadcast = "relays"
    with pytest.raises(ValueError, match="bridge.broadcast"):
        validate(c)


def test_kl_penalty_runs_on_one_learner_process_only():
    from learner_jax.run_config import validate

    c = tiny_arith()
    c.loss.kl_coef = 0.1
    validate(c)  # one process: the learner holds the reference policy
    c.distributed.num_processes = 2  # followers would have no reference policy
    with pytest.raises(ValueError, match=r"loss.kl_coef=0.1 is not supported.*processes"):
        validate(c)


def test_fleet_engines_fit_the_batch():
    from learner_jax.run_config import fleet_config

    c = tiny_arith()
    assert fleet_config(c).max_model_len == 512  # the worker's own default
    c.batch.max_prompt_len, c.batch.max_answer_len = 1000, 24
    assert fleet_config(c).max_model_len == 1024


def test_staleness_auto_reaches_the_controller_with_its_bounds():
    from learner_jax import run_config

    c = tiny_arith()
    c.staleness, c.staleness_min, c.staleness_max, c.publish_every = "auto", 1, 3, 2
    ctl = run_config.controller_config(c, vocab_size=64, eos_id=2)
    assert (ctl.staleness_auto, ctl.staleness_min, ctl.staleness_max) == (True, 1, 3)
    assert ctl.staleness == 1  # starts at S_min, moves up on evidence
    run_config.check_rl_schedule(c)  # S_min = 1 = publish_every - 1: every step is fed
    c.staleness = 2  # a fixed S: no adaptation, and the bounds keys are ignored
    ctl = run_config.controller_config(c, vocab_size=64, eos_id=2)
    assert (ctl.staleness_auto, ctl.staleness) == (False, 2)
    assert run_config.staleness_bounds(c) == (2, 2, False)


@pytest.mark.parametrize(
    "staleness, lo, hi, match",
    [
        ("auto", 0, 3, "publish_every - 1"),  # S_min below the schedule rule (kappa = 2)
        ("auto", 3, 1, "staleness_min <= staleness_max"),
        ("fast", 0, 3, 'int S >= 0 or "auto"'),
        (1.5, 0, 3, 'int S >= 0 or "auto"'),
    ],
)
def test_bad_staleness_settings_are_refused(staleness, lo, hi, match):
    from learner_jax import run_config

    c = tiny_arith()
    c.staleness, c.staleness_min, c.staleness_max, c.publish_every = staleness, lo, hi, 2
    with pytest.raises(ValueError, match=match):
        run_config.check_rl_schedule(c)


def test_task_thinking_reaches_the_environments_turns():
    """A chat-template environment's turns take the run's thinking switch as an option
    (so workers and the reward pool build the same turns); a plain one is left alone."""
    c = tiny_arith()
    c.task = c.task.__class__()
    c.task.name, c.task.turns, c.task.thinking = "tool_arith", "qwen3", "off"
    task = train.make_task(c)
    assert task.options["thinking"] == "off"
    assert task.env.turns.tool_results(["1"]).endswith("assistant\n<think>\n\n</think>\n\n")
    c.task.turns = "plain"
    assert "thinking" not in train.make_task(c).options
