"""Held-out evaluation: the jitted, left-padded greedy decoder emits exactly what
transformers' greedy `generate` emits for the same weights and prompts, and accuracy is
the task's reward on those completions."""

import jax
import numpy as np
import pytest

from bridge import tasks
from bridge.contracts.prompt import TextCodec
from bridge.model.config import ModelConfig
from learner_jax.evaluation import evaluate
from learner_jax.model import hf_import, sharding

NEW = 6


@pytest.fixture(scope="module")
def setup(tiny_model_dir):
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    cfg, params = hf_import.load_hf_params(tiny_model_dir, mesh)
    task = tasks.make_task("arithmetic", eval_size=12)
    codec = TextCodec(tiny_model_dir)
    ev = evaluate.Evaluator(cfg, codec, task, evaluate.EvalConfig(16, NEW))
    return tiny_model_dir, params, mesh, task, codec, ev


def test_greedy_matches_transformers(setup):
    import torch
    import transformers

    model_dir, params, mesh, task, codec, ev = setup
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    got = ev.completions(params, mesh)
    assert len(got) == len(ev.prompts) == 12
    for prompt, text in zip(ev.prompts, got, strict=True):
        ids = torch.tensor([codec.encode_prompt(prompt.text)])
        with torch.no_grad():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW,
                do_sample=False,
                eos_token_id=codec.eos_id,
                pad_token_id=codec.pad_id,
            )
        want = out[0, ids.shape[1] :].tolist()
        if codec.eos_id in want:
            want = want[: want.index(codec.eos_id)]
        assert text == codec.decode(want), prompt.text


def test_accuracy_is_the_task_reward(setup):
    _, params, mesh, task, _, ev = setup
    texts = ev.completions(params, mesh)
    want = np.mean([tasks.score(task, p, t) >= 1 for p, t in zip(ev.prompts, texts, strict=True)])
    assert ev.accuracy(params, mesh) == pytest.approx(want)
    # A "model" that always answers correctly scores 1: the scoring path can tell.
    assert all(tasks.score(task, p, p.answer) == 1.0 for p in ev.prompts)


def test_prompt_too_long_is_refused(setup):
    model_dir, _, _, task, codec, _ = setup
    with pytest.raises(ValueError, match="max_prompt_len"):
        evaluate.Evaluator(
            ModelConfig.from_hf_dir(model_dir),
            codec,
            task,
            evaluate.EvalConfig(3, NEW),
        )
