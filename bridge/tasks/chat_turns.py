"""How environment turns are written between model turns, in a chat template's own format.

    turns = turn_format("qwen3")
    turns.env_text([{"role": "tool", "content": "1776"}])
    # '\n<|im_start|>user\n<tool_response>\n1776\n</tool_response><|im_end|>\n'
    # '<|im_start|>assistant\n'

An episode's tokens are built by appending (rollout_gpu/episodes.py): the model's turn is
the ids the engine sampled, ending with the template's end-of-turn token (Qwen3
`<|im_end|>`, Llama-3 `<|eot_id|>`: the run stops on it), and the environment's turn is
`env_text(messages)` encoded and appended: the rest of the template's rendering of those
messages after the assistant's end-of-turn token, through the next generation prompt. The
conversation is never rendered again, because a template may rewrite history: Qwen3's
drops the reasoning of assistant turns before the last user query and puts an empty
`<think>` block on the last one; Llama-3's trims every message and re-serializes tool
calls as `{"name": ..., "parameters": ...}`. Re-rendering would train the learner on
tokens no policy sampled (tests/bridge/tasks/token_exact_test.py shows both).

`env_text` is derived from the template itself, not written by hand: render a probe
conversation [user, assistant with a marker] + messages with the generation prompt and
keep what follows the marker's end-of-turn token. So a template's tool and observation
format (Qwen3 wraps tool results in `<tool_response>` inside a user turn, Llama-3 uses an
`ipython` header) comes from the template, and a new family needs only its template file.

A model turn cut by the token budget (`turn_max_tokens`: no end-of-turn token sampled) is
closed before the environment's turn: `cut_turn_close` is the template's end-of-turn token,
appended as an environment token (mask 0: the policy did not sample it), so the sequence
stays the template's rendering of an assistant message with the cut text, and the next
turn sees a well-formed conversation instead of a tool result glued onto a half-written
turn. Both sides derive it from the ids alone (a turn is cut when it does not end with
the end-of-turn token's ids), so the controller's check of environment tokens covers it.

`PlainTurns` is the format for a model with no chat template (the tiny character-level
models): a tool result is `\n<tool_response>\n...\n</tool_response>\n`, an observation is
its text on a new line.

The environment's turn ends with the generation prompt, which a template may write per
mode: Qwen3's with `enable_thinking=False` closes an empty think block there
(`<|im_start|>assistant\n<think>\n\n</think>\n\n`), as in the run's prompt. So the format
takes the run's thinking switch (`turn_format(family, thinking)`, "" | "on" | "off", the
prompt's `PromptFormat.thinking`; the environment's `thinking` option, which
learner_jax/train.py sets from `task.thinking`): every model turn then starts after the
same generation prompt as the first.

Families by name (both sides build an environment from its options, so the name is data):
"plain", "qwen3" (bridge/model/qwen3_chat_template.jinja), "llama3"
(bridge/model/llama3_chat_template.jinja, Meta's Llama-3.2 template with the date pinned,
so a rendering does not change at midnight).
"""

from __future__ import annotations

import abc
import functools
import os

from bridge.contracts.prompt import _compile

_MARK = "\x00ASSISTANT-TURN-MARK\x00"
_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model")


class TurnFormat(abc.ABC):
    """`end_of_turn`: the text of the token a model turn ends with (SFT examples of later
    turns join the earlier ones with it, as the engine's stop token joins them)."""

    end_of_turn: str = ""

    @abc.abstractmethod
    def env_text(self, messages: list[dict]) -> str:
        """The text after a model turn's end token: `messages` (role "tool" or "user")
        and the next generation prompt."""

    def tool_results(self, results: list[str]) -> str:
        return self.env_text([{"role": "tool", "content": r} for r in results])


class PlainTurns(TurnFormat):
    def __init__(self, end_of_turn: str = "<eos>"):
        self.end_of_turn = end_of_turn

    def env_text(self, messages: list[dict]) -> str:
        parts = []
        for m in messages:
            if m["role"] == "tool":
                parts.append(f"\n<tool_response>\n{m['content']}\n</tool_response>")
            elif m["role"] == "user":
                parts.append(f"\n{m['content']}")
            else:
                raise ValueError(f"an environment turn is role tool or user, got {m['role']!r}")
        return "".join(parts) + "\n"


class TemplateTurns(TurnFormat):
    """`env_text` from a chat template (module docstring). `special_tokens` are passed to the
    template as transformers passes them (bos_token, eos_token, ...); `template_kwargs`
    pin what a template would otherwise take from the clock (Llama-3's date)."""

    def __init__(
        self,
        template: str,
        end_of_turn: str,
        special_tokens: dict | None = None,
        template_kwargs: dict | None = None,
    ):
        self.template, self.end_of_turn = template, end_of_turn
        self.kwargs = {**(special_tokens or {}), **(template_kwargs or {})}

    def render(
        self, messages: list[dict], tools=None, add_generation_prompt=False, **template_kwargs
    ) -> str:
        """The template's rendering (as transformers' apply_chat_template, tokenize=False)."""
        return _compile(self.template).render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **{**self.kwargs, **template_kwargs},
        )

    def env_text(self, messages: list[dict]) -> str:
        for m in messages:
            if m.get("role") not in ("tool", "user"):
                raise ValueError(f"an environment turn is role tool or user, got {m!r}")
        probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
        full = self.render(probe + list(messages), add_generation_prompt=True)
        at = full.find(_MARK + self.end_of_turn)
        if at < 0:
            raise ValueError(
                f"the template does not end an assistant turn with {self.end_of_turn!r} "
                "right after its content: cannot append environment turns to sampled ids"
            )
        return full[at + len(_MARK) + len(self.end_of_turn) :]


def cut_turn_close(env, turn_ids: list[int], encode) -> str:
    """The text between model turn `turn_ids` and `env`'s next observation: the template's
    end-of-turn token when the turn does not end with it (cut by the token budget; module
    docstring), else ''. `encode`: text -> ids without special tokens added. Only a chat
    template's turns are closed: a plain-format environment (a game of one-token turns,
    Kuhn poker) has no turn structure to close."""
    turns = getattr(env, "turns", None)
    if not isinstance(turns, TemplateTurns):
        return ""
    eot = list(encode(turns.end_of_turn))
    return "" if list(turn_ids[-len(eot) :]) == eot else turns.end_of_turn


def _read(name: str) -> str:
    with open(os.path.join(_MODEL_DIR, name), encoding="utf-8") as f:
        return f.read()


FAMILIES = ("plain", "qwen3", "llama3")
LLAMA3_DATE = "26 Jul 2024"  # the template's own fallback date


THINKING = ("", "on", "off")


@functools.cache
def turn_format(family: str, thinking: str = "") -> TurnFormat:
    """The family's format; `thinking` the template's `enable_thinking` ("": undefined,
    the template's default), as the run's prompt passes it (module docstring)."""
    if thinking not in THINKING:
        raise ValueError(f"thinking must be one of {THINKING}, got {thinking!r}")
    switch = {"enable_thinking": thinking == "on"} if thinking else {}
    if family == "plain":
        if thinking:
            raise ValueError("the thinking switch needs a chat template's turns, not 'plain'")
        return PlainTurns()
    if family == "qwen3":
        return TemplateTurns(
            _read("qwen3_chat_template.jinja"),
            "<|im_end|>",
            {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
            switch,
        )
    if family == "llama3":
        return TemplateTurns(
            _read("llama3_chat_template.jinja"),
            "<|eot_id|>",
            {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
            {"date_string": LLAMA3_DATE, **switch},
        )
    raise ValueError(f"turn format must be one of {FAMILIES}, got {family!r}")
