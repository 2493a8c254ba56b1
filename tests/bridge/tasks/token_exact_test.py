"""Token-in/token-out: an episode's ids are appended, never re-rendered (chat_turns.py).

For each template family (Qwen3 with <think> and tool calls; Llama-3.2), on a real
tokenizer of the family's format built here:
- the environment turn echo2 appends is the template's own rendering of that message:
  when the model's turns are already in the template's canonical form, appending equals
  rendering the whole conversation, token for token;
- when they are not (what a sampling policy writes), re-rendering the conversation
  changes tokens: Qwen3 drops the reasoning of turns before the last user message and
  rewrites tool-call JSON; Llama-3 trims each message. echo2's sequence stays the
  sampled ids.
"""

import json
import os

import pytest

from bridge.contracts.prompt import PromptFormat, TextCodec
from bridge.model import qwen3_tokenizer
from bridge.tasks.chat_turns import LLAMA3_DATE, turn_format
from bridge.tasks.tool_arith import CALC
from bridge.tasks.tool_calls import ToolCall, format_call, parse_tool_calls

LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>")  # fmt: skip
TOOLS = [CALC.schema]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3_tok"))
    qwen3_tokenizer.save_qwen3_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    """A Llama-3-format tokenizer: byte-level BPE (one token per byte, no merges) with
    Llama-3's special tokens, BOS <|begin_of_text|>, EOS <|eot_id|>, and the Llama-3.2
    chat template (bridge/model/llama3_chat_template.jinja)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from tokenizers import pre_tokenizers as pre

    path = str(tmp_path_factory.mktemp("llama3_tok"))
    vocab = {sym: i for i, sym in enumerate(sorted(pre.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA3_SPECIAL])
    tok.save(os.path.join(path, "tokenizer.json"))
    template = turn_format("llama3").template
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        config = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
        config.update(chat_template=template, tokenizer_class="PreTrainedTokenizerFast")
        json.dump(config, f)
    return path


def _appended(codec, fmt, question, turns, env_messages):
    """echo2's episode: prompt ids, then each sampled turn's ids (+ its end-of-turn id, the
    engine's stop token) and the environment turn's ids, appended."""
    ids = codec.encode_prompt(question)
    eot = codec.encode(fmt.end_of_turn)
    for i, turn in enumerate(turns):
        ids += codec.encode(turn) + eot
        if i < len(env_messages):
            ids += codec.encode(fmt.env_text(env_messages[i]))
    return ids


def _rendered(codec, fmt, question, turns, env_messages, tools):
    messages = [{"role": "user", "content": question}]
    for i, turn in enumerate(turns):
        messages.append({"role": "assistant", "content": turn})
        if i < len(env_messages):
            messages += env_messages[i]
    return codec.encode(fmt.render(messages, tools=tools))


def test_qwen3_tool_episode_appended_equals_the_template_when_turns_are_canonical(qwen3):
    codec = TextCodec(qwen3, PromptFormat("chat", tools=json.dumps(TOOLS)))
    fmt = turn_format("qwen3")
    call = format_call(ToolCall("calc", {"expr": "37*48"}))
    turns = ["<think>\nI need the tool.\n</think>\n\n" + call,
             "<think>\nThe tool says 1776.\n</think>\n\n1776"]  # fmt: skip
    env = [[{"role": "tool", "content": "1776"}]]
    got = _appended(codec, fmt, "37*48=", turns, env)
    # The template's newline after the last turn's <|im_end|> starts the next turn.
    assert got + codec.encode("\n") == _rendered(codec, fmt, "37*48=", turns, env, TOOLS)
    # The tool result sits where Qwen3 puts it: a user turn of <tool_response> tags.
    text = codec.tok.decode(got, skip_special_tokens=False)
    assert "<|im_start|>user\n<tool_response>\n1776\n</tool_response><|im_end|>" in text
    assert parse_tool_calls(turns[0]) == [ToolCall("calc", {"expr": "37*48"})]


def test_qwen3_rerendering_drops_earlier_reasoning_and_rewrites_calls(qwen3):
    codec = TextCodec(qwen3, PromptFormat("chat", tools=json.dumps(TOOLS)))
    fmt = turn_format("qwen3")
    # A game: observations are user turns, so the first turn precedes the last user query.
    turns = ["<think>\nA king: bet.\n</think>\n\nb", "<think>\nThey called.\n</think>\n\nc"]
    env = [[{"role": "user", "content": "opp c. you K:"}]]
    sampled = _appended(codec, fmt, "Kuhn K. you K:", turns, env)
    rendered = _rendered(codec, fmt, "Kuhn K. you K:", turns, env, TOOLS)
    assert sampled != rendered
    assert "A king: bet." in codec.tok.decode(sampled, skip_special_tokens=False)
    assert "A king: bet." not in codec.tok.decode(rendered, skip_special_tokens=False)
    # A call written compactly (as a policy may) is re-serialized by the template.
    call = '<tool_call>{"name":"calc","arguments":{"expr":"37*48"}}</tool_call>'
    calls = [{"function": {"name": "calc", "arguments": {"expr": "37*48"}}}]
    messages = [
        {"role": "user", "content": "37*48="},
        {"role": "assistant", "content": "", "tool_calls": calls},
    ]
    appended = codec.encode_prompt("37*48=") + codec.encode(call + "<|im_end|>")
    assert appended != codec.encode(fmt.render(messages, tools=TOOLS))[: len(appended)]


def test_llama3_appended_equals_the_template_and_rerendering_trims(llama3):
    fmt = turn_format("llama3")
    codec = TextCodec(llama3, PromptFormat("chat", tools=json.dumps(TOOLS)))
    question = "What is 37*48?"
    # The prompt: BOS written by the template, the tools in the first user turn.
    prompt = codec.tok.decode(codec.encode_prompt(question), skip_special_tokens=False)
    assert prompt.startswith("<|begin_of_text|><|start_header_id|>system")
    assert '"name": "calc"' in prompt and prompt.endswith("assistant<|end_header_id|>\n\n")
    canonical = ['{"name": "calc", "parameters": {"expr": "37*48"}}', "1776"]
    env = [[{"role": "tool", "content": "1776"}]]
    # The template's date is the clock's unless pinned: pin it on both sides.
    codec_fixed = TextCodec(llama3, PromptFormat("chat", tools=json.dumps(TOOLS)))
    codec_fixed.special_tokens = {**codec_fixed.special_tokens, "date_string": LLAMA3_DATE}
    got = _appended(codec_fixed, fmt, question, canonical, env)
    assert got == _rendered(codec_fixed, fmt, question, canonical, env, TOOLS)
    assert "<|start_header_id|>ipython<|end_header_id|>" in fmt.tool_results(["1776"])
    sampled_turns = [canonical[0] + "\n", " 1776"]  # what a policy samples: stray spaces
    sampled = _appended(codec_fixed, fmt, question, sampled_turns, env)
    assert sampled != _rendered(codec_fixed, fmt, question, sampled_turns, env, TOOLS)
    assert codec_fixed.encode(" 1776<|eot_id|>") == sampled[-len(codec_fixed.encode(" 1776")) - 1 :]


def test_tools_are_declared_through_the_template_as_transformers_does(qwen3):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(qwen3)
    codec = TextCodec(qwen3, PromptFormat("chat", tools=json.dumps(TOOLS)))
    want = hf.apply_chat_template(
        [{"role": "user", "content": "37*48="}], tools=TOOLS, add_generation_prompt=True,
        tokenize=True, return_dict=False,
    )  # fmt: skip
    assert codec.encode_prompt("37*48=") == list(want)
    assert "<tools>" in codec.tok.decode(list(want), skip_special_tokens=False)


def _trajectory(prompt_ids, segments):
    from bridge.control.protocol import WorkerTrajectory

    ids = [i for _, s in segments for i in s]
    mask = [m for m, s in segments for _ in s]
    return WorkerTrajectory(
        prompt_id="p", sample_index=0, prompt_token_ids=prompt_ids, completion_token_ids=ids,
        logprobs=[-1.0 if m else 0.0 for m in mask], versions=[0] * len(ids),
        finish_reason="stop", completion_mask=mask,
    )  # fmt: skip


def test_a_turn_cut_by_the_budget_is_closed_with_the_templates_end_of_turn(qwen3, llama3):
    """A model turn cut at turn_max_tokens has no end-of-turn token; the environment turn
    after it starts with one (an environment token): the sequence is the template's own
    rendering of an assistant message holding the cut text. The controller's scoring
    expects exactly that, and refuses an environment turn glued onto the open turn."""
    from bridge.control.intake.rewards import RewardScorer
    from bridge.control.intake.validation import SubmissionError
    from bridge.tasks import Prompt, make_task
    from bridge.tasks.chat_turns import cut_turn_close

    cut = '<tool_call>{"name": "calc", "argu'  # the budget ran out mid-call
    for family, path in (("qwen3", qwen3), ("llama3", llama3)):
        task = make_task("tool_arith", turns=family)
        codec = TextCodec(path, PromptFormat("chat", tools=json.dumps(TOOLS)))
        codec.special_tokens = {**codec.special_tokens, "date_string": LLAMA3_DATE}
        env, fmt = task.new_env(), turn_format(family)
        question = env.reset(7)
        obs, _, done = env.step(cut)
        assert not done and "error: malformed tool call" in obs
        cut_ids = codec.encode(cut)
        closed = codec.encode(cut + fmt.end_of_turn)
        assert cut_turn_close(env, cut_ids, codec.encode) == fmt.end_of_turn
        assert cut_turn_close(env, closed, codec.encode) == ""
        assert cut_turn_close(make_task("tool_arith").new_env(), cut_ids, codec.encode) == ""
        # What the template renders for [user, assistant(cut), tool result] + the prompt.
        error = obs.split("error: ")[1].split("\n</tool_response>")[0].split('"')[0]
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": cut}]
        messages.append({"role": "tool", "content": "error: " + error})
        rendered = codec.encode(fmt.render(messages, tools=TOOLS, add_generation_prompt=True))
        env_ids = codec.encode(cut_turn_close(env, cut_ids, codec.encode) + obs)
        appended = codec.encode_prompt(question) + cut_ids + env_ids
        assert appended == rendered, codec.tok.decode(appended, skip_special_tokens=False)
        # The controller scores it; the environment turn without the close is refused.
        answer = codec.encode(str(env.answer)) + codec.encode(fmt.end_of_turn)
        scorer = RewardScorer(task, codec, timeout_s=0)
        prompt = Prompt("p", question, "7")
        ok = _trajectory(codec.encode_prompt(question), [(1, cut_ids), (0, env_ids), (1, answer)])
        (scored,), errors = scorer.score_group(0, prompt, [ok])
        assert scored.reward == 1.0 and errors == 0, family
        glued = [(1, cut_ids), (0, codec.encode(obs)), (1, answer)]
        with pytest.raises(SubmissionError, match="differ from the replay"):
            scorer.score_group(0, prompt, [_trajectory(codec.encode_prompt(question), glued)])


@pytest.mark.parametrize("thinking", ["", "on", "off"])
def test_every_turn_starts_after_the_prompts_generation_prompt(qwen3, thinking):
    """The environment's turn ends with the template's generation prompt in the run's
    thinking mode, as the prompt does (Qwen3 off: an empty think block), and is what
    transformers renders after the assistant's turn in that mode."""
    from transformers import AutoTokenizer

    fmt = turn_format("qwen3", thinking)
    codec = TextCodec(qwen3, PromptFormat("chat", thinking=thinking, tools=json.dumps(TOOLS)))
    prompt = codec.tok.decode(codec.encode_prompt("37*48="), skip_special_tokens=False)
    env = fmt.tool_results(["1776"])
    head = "<|im_start|>assistant\n"
    assert env[env.rindex(head) :] == prompt[prompt.rindex(head) :]
    assert ("<think>\n\n</think>\n\n" in env) == (thinking == "off")
    switch = {"enable_thinking": thinking == "on"} if thinking else {}
    hf = AutoTokenizer.from_pretrained(qwen3)
    messages = [{"role": "user", "content": "37*48="}, {"role": "assistant", "content": "X"},
                {"role": "tool", "content": "1776"}]  # fmt: skip
    want = hf.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                  tokenize=False, **switch)  # fmt: skip
    assert want.endswith("X<|im_end|>" + env)
