"""Reasoning models (issue 26 item 4): the controller scores only the text after the last
`</think>`. On the Qwen3 hybrid-thinking template (bridge/model/qwen3_tokenizer.py) an
answer written inside the thinking earns nothing, an unterminated think scores 0, and the
thinking's token count is recorded; on a template without thinking (the tiny character
model's plain format) the whole text is the answer, as before. `task.thinking` reaches the
template as `enable_thinking`, rendered as transformers renders it."""

import pytest

from bridge.contracts import thinking
from bridge.contracts.prompt import PromptFormat, TextCodec
from bridge.control.intake.rewards import RewardScorer
from bridge.control.protocol import WorkerTrajectory
from bridge.model import qwen3_tokenizer
from bridge.tasks import Prompt, Task

PROMPT = Prompt("p0", "What is 6 times 7?", "42")


class ExactAnswer(Task):
    """1 when the answer (stripped) is the reference."""

    name = "exact_answer_test"

    def train_prompts(self, seed):
        yield PROMPT

    def eval_prompts(self):
        return [PROMPT]

    def reward(self, prompt, completion):
        return float(completion.strip() == prompt.answer)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3_tok"))
    qwen3_tokenizer.save_qwen3_tokenizer(path)
    return path


def score(codec, texts):
    scorer = RewardScorer(ExactAnswer(), codec, timeout_s=0.0)
    prompt_ids = codec.encode_prompt(PROMPT.text)
    trajs = []
    for i, text in enumerate(texts):
        ids = codec.encode(text) + [codec.eos_id]
        trajs.append(
            WorkerTrajectory(
                prompt_id="p0", sample_index=i, prompt_token_ids=prompt_ids,
                completion_token_ids=ids, logprobs=[-0.5] * len(ids), versions=[0] * len(ids),
                finish_reason="stop",
            )
        )  # fmt: skip
    out, errors = scorer.score_group(0, PROMPT, trajs)
    assert errors == 0  # unterminated thinking is the policy's doing, not a reward failure
    return out


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_qwen3_template_scores_after_the_last_think(qwen3_dir, mode):
    codec = TextCodec(qwen3_dir, PromptFormat("chat", thinking=thinking.prompt_thinking(mode)))
    out = score(
        codec,
        [
            "<think>\n6 x 7 = 42\n</think>\n\n42",  # thought, then answered
            "<think>\nthe answer is 42\n</think>\n\n41",  # right only inside the thinking
            "<think>\n42",  # never closed
            "<think>a</think><think>42</think>42",  # the last block counts
            "42",  # no thinking at all
        ],
    )
    assert [t.reward for t in out] == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert out[2].reward_error.startswith("UnterminatedThinking")
    close = codec.tok.token_to_id("</think>")
    first = codec.encode("<think>\n6 x 7 = 42\n")
    assert out[0].think_tokens == len(first) + 1 and close is not None
    assert out[2].think_tokens == len(out[2].completion_token_ids)
    assert out[4].think_tokens == 0


def test_template_without_thinking_scores_the_whole_text(tiny_model_dir):
    codec = TextCodec(tiny_model_dir)  # plain format, no think tags in any template
    assert not thinking.scores_after_think(codec.fmt, codec.chat_template)
    out = score(codec, ["42", "41"])
    assert [t.reward for t in out] == [1.0, 0.0]
    assert [t.think_tokens for t in out] == [0, 0]


def test_a_prompt_that_opens_the_block_starts_the_completion_inside_it():
    assert thinking.opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not thinking.opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert thinking.split("6 x 7 = 42", opened=True).answer is None
    assert thinking.split("6 x 7\n</think>\n42", opened=True).answer == "\n42"
    assert thinking.split("42").answer == "42"


@pytest.mark.parametrize("mode, flag", [("on", True), ("off", False), ("auto", None)])
def test_enable_thinking_reaches_the_template_as_transformers_passes_it(qwen3_dir, mode, flag):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(qwen3_dir)
    kwargs = {} if flag is None else {"enable_thinking": flag}
    messages = [{"role": "user", "content": PROMPT.text}]
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    want_ids = hf(want, add_special_tokens=False)["input_ids"]
    codec = TextCodec(qwen3_dir, PromptFormat("chat", thinking=thinking.prompt_thinking(mode)))
    assert codec.encode_prompt(PROMPT.text) == want_ids
    assert ("<think>\n\n</think>" in want) == (mode == "off")
    with pytest.raises(ValueError, match="task.thinking"):
        thinking.prompt_thinking("maybe")
