"""The tiny model factory writes directories that transformers loads as-is."""

import json
import os

import numpy as np
import pytest

from bridge.model import tiny_model
from bridge.model.config import ModelConfig


def test_tokenizer_is_character_level_and_round_trips(tiny_model_dir):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "What is 12 + 34?\nAnswer: 46."
    ids = tok(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text)
    assert tok.decode(ids) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (
        tiny_model.PAD_ID,
        tiny_model.BOS_ID,
        tiny_model.EOS_ID,
    )


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_config_round_trips_through_hf_json(family, tiny_model_dirs):
    path = tiny_model_dirs[family]
    cfg = ModelConfig.from_hf_dir(path)
    assert cfg == tiny_model.tiny_config(family)
    with open(os.path.join(path, "config.json")) as f:
        assert ModelConfig.from_hf_dict(json.load(f)) == cfg


def test_weights_are_deterministic_per_seed():
    cfg = tiny_model.tiny_config("qwen3")
    a, b = tiny_model.random_hf_weights(cfg, 7), tiny_model.random_hf_weights(cfg, 7)
    c = tiny_model.random_hf_weights(cfg, 8)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["model.norm.weight"], c["model.norm.weight"])


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig.from_hf_dict({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(ValueError, match="multiple"):
        tiny_model.tiny_config("qwen3", num_heads=4, num_kv_heads=3)


def test_qwen3_format_model_never_stops_when_asked(tmp_path):
    """The Qwen3-tokenizer tiny model loads in transformers with Qwen3's ids (no BOS, stop at
    <|im_end|> or <|endoftext|>), and with never_stop its sampled answers run to the limit."""
    import torch
    import transformers

    cfg = tiny_model.qwen3_config(tie_word_embeddings=False)
    path = tiny_model.make_tiny_model(str(tmp_path / "m"), cfg, tokenizer="qwen3", never_stop=True)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    gen = transformers.GenerationConfig.from_pretrained(path)
    stops = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert tok.bos_token_id is None and gen.eos_token_id == stops and cfg.vocab_size >= len(tok)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "1+1?"}], add_generation_prompt=True, return_dict=False
    )
    torch.manual_seed(0)
    out = hf.generate(
        torch.tensor([ids] * 4), do_sample=True, temperature=0.7, max_new_tokens=128, top_k=0
    )
    answers = out[:, len(ids) :]
    assert answers.shape[1] == 128 and not np.isin(answers.numpy(), stops).any()
    with pytest.raises(ValueError, match="untied"):
        tiny_model.make_tiny_model(
            str(tmp_path / "t"), tiny_model.qwen3_config(), tokenizer="qwen3", never_stop=True
        )
