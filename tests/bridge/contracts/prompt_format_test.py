"""The prompt contract against transformers: a Qwen3-format tokenizer (Qwen3's own chat
template, byte-level BPE, its added tokens; built locally) gives the same prompt ids
from `TextCodec` (tokenizers + jinja2, the controller's side) as from transformers'
`apply_chat_template` and from the worker-side helper on an HF tokenizer, thinking on,
off and default, with and without a system prompt; plain prompts stay BOS + text."""

import os
import shutil

import pytest

from bridge.contracts.prompt import PromptFormat, TextCodec
from bridge.model import qwen3_tokenizer, tiny_model

TEXTS = ["What is 12+30? Answer with a number.", "Réponds: ünï 😀\n  two  spaces, tab\t."]
FORMATS = [
    PromptFormat("chat"),
    PromptFormat("chat", thinking="on"),
    PromptFormat("chat", thinking="off"),
    PromptFormat("chat", system="You are a careful mathematician."),
    PromptFormat("chat", system="Be brief.", thinking="off"),
]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3_tok"))
    qwen3_tokenizer.save_qwen3_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def hf_tokenizer(qwen3_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen3_dir)


def test_template_is_qwen3s_hybrid_thinking_template(hf_tokenizer):
    assert type(hf_tokenizer).__name__.startswith("Qwen2Tokenizer")
    assert hf_tokenizer.bos_token_id is None and hf_tokenizer.eos_token == "<|im_end|>"
    assert "enable_thinking is defined and enable_thinking is false" in hf_tokenizer.chat_template


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"sys={bool(f.system)}-think={f.thinking}")
def test_chat_prompt_ids_equal_transformers(qwen3_dir, hf_tokenizer, fmt):
    from rollout_gpu.generate import prompt_token_ids

    codec = TextCodec(qwen3_dir, fmt)
    for text in TEXTS:
        kwargs = fmt.template_kwargs()
        messages = fmt.messages(text)
        want_text = hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **kwargs
        )
        want = hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
        )
        got = codec.encode_prompt(text)
        assert got == list(want)
        assert prompt_token_ids(hf_tokenizer, text, fmt) == got  # the worker-side helper
        # The switch and the system prompt really are in the rendered prompt.
        assert want_text.endswith(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
            if fmt.thinking == "off"
            else "<|im_start|>assistant\n"
        )
        assert want_text.startswith("<|im_start|>system\n" if fmt.system else "<|im_start|>user\n")
        assert codec.decode(got).endswith("assistant\n" if fmt.thinking != "off" else "\n\n")
        im_start = hf_tokenizer.convert_tokens_to_ids("<|im_start|>")
        assert got.count(im_start) == (3 if fmt.system else 2)  # special tokens, not text


def test_plain_prompt_is_bos_then_text(qwen3_dir, hf_tokenizer, tiny_model_dir):
    from transformers import AutoTokenizer

    from rollout_gpu.generate import prompt_token_ids

    text = TEXTS[1]
    assert TextCodec(qwen3_dir).encode_prompt(text) == hf_tokenizer.encode(
        text, add_special_tokens=False
    )  # Qwen3 has no BOS
    tiny = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = TextCodec(tiny_model_dir).encode_prompt("12+30=")
    assert ids == [tiny_model.BOS_ID] + tiny.encode("12+30=", add_special_tokens=False)
    assert prompt_token_ids(tiny, "12+30=") == ids


def test_chat_template_file_wins_over_the_config(qwen3_dir, tmp_path):
    from transformers import AutoTokenizer

    path = str(tmp_path / "tok")
    shutil.copytree(qwen3_dir, path)
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}{{ eos_token }}"
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(template)
    hf = AutoTokenizer.from_pretrained(path)
    fmt = PromptFormat("chat", system="s")
    want = hf.apply_chat_template(
        fmt.messages("hi"), add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert TextCodec(path, fmt).encode_prompt("hi") == list(want)
    assert hf.decode(want) == "[system] s[user] hi<|im_end|>"


def test_bad_formats_are_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="has no chat template"):
        TextCodec(tiny_model_dir, PromptFormat("chat"))  # the char tokenizer has none
    with pytest.raises(ValueError, match="need the chat format"):
        PromptFormat("plain", system="hello")
    with pytest.raises(ValueError, match="thinking must be one of"):
        PromptFormat("chat", thinking="yes")
    with pytest.raises(ValueError, match="format must be one of"):
        PromptFormat("markdown")
