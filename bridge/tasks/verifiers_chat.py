"""A chat template's own text for the turns an environment adds, and Qwen3 tool calls.

    chat = ChatFormat.qwen3(thinking=False)
    prompt = chat.prompt(messages, tools)          # system + user, tools declared, gen prompt
    obs = chat.continuation([tool_message], tools) # appended after a sampled model turn
    text, calls, errors = parse_tool_calls(action) # Qwen3 <tool_call>{json}</tool_call>

Why text and not ids: an echo2 environment speaks text (bridge/tasks/env.py) and both the
worker and the trusted replay encode each observation on its own, so the ids appended after
a model turn are the same on both sides and are checked token for token. The model's own
turns are never re-rendered: the continuation starts right after the turn's end-of-turn
token (which the model sampled) and is what the template writes between that token and the
next generation prompt. Rendering the whole conversation again would not do: Qwen3's
template rewrites history (an earlier turn's reasoning disappears).

`continuation` finds that text without trusting the history to render stably: it renders a
placeholder conversation (one user turn, one assistant turn holding a marker, then the new
messages, with the generation prompt) and cuts right after the first end-of-turn token that
follows the marker. Only the new messages and the generation prompt come after the cut.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Any

from bridge.contracts.prompt import _compile

_MARKER = "ECHO2-SAMPLED-TURN"
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_THINK = re.compile(r"^\s*<think>(.*?)</think>\s*", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """A chat template with the special tokens it is rendered with."""

    template: str
    eos: str  # the end-of-turn token the model samples (Qwen3: <|im_end|>)
    special_tokens: tuple[tuple[str, str], ...] = ()
    thinking: bool | None = None  # Qwen3's enable_thinking; None = the template's default

    @classmethod
    def qwen3(cls, thinking: bool | None = False) -> ChatFormat:
        from bridge.model import qwen3_tokenizer as q

        return cls(
            q.chat_template(),
            q.EOS_TOKEN,
            (("eos_token", q.EOS_TOKEN), ("pad_token", q.PAD_TOKEN)),
            thinking,
        )

    def render(self, messages: Sequence[dict], tools: Sequence[dict] | None, gen: bool) -> str:
        kwargs = dict(self.special_tokens)
        if self.thinking is not None:
            kwargs["enable_thinking"] = self.thinking
        return _compile(self.template).render(
            messages=list(messages),
            tools=list(tools) if tools else None,
            documents=None,
            add_generation_prompt=gen,
            **kwargs,
        )

    def prompt(self, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
        """The episode's first text: the opening messages, tools declared, generation prompt."""
        return self.render(messages, tools, gen=True)

    def continuation(self, new: Sequence[dict], tools: Sequence[dict] | None = None) -> str:
        """What follows a sampled model turn's end-of-turn token: `new` (tool results, user
        turns) in the template's format, then the next generation prompt."""
        head = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARKER}]
        full = self.render(head + list(new), tools, gen=True)
        at = full.find(_MARKER)
        end = full.find(self.eos, at) if at >= 0 else -1
        if end < 0:
            raise ValueError(
                f"chat template does not close an assistant turn with {self.eos!r}: cannot "
                "tell where a sampled turn ends"
            )
        return full[end + len(self.eos) :]


@dataclasses.dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall], list[str]]:
    """(the text outside tool-call blocks, the well-formed calls, one error per malformed
    block). A call is Qwen3's `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
    `arguments` may also be a JSON string of an object (some models emit that). An opened
    block that never closes is malformed too: a cut-off call must not pass as prose."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for i, m in enumerate(_TOOL_CALL.finditer(text)):
        body = m.group(1).strip()
        try:
            call = json.loads(body)
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError('need an object with a string "name"')
            args = call.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(args, dict):
                raise ValueError('"arguments" must be an object')
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            errors.append(f"malformed tool call {body[:200]!r}: {e}")
            continue
        calls.append(ToolCall(f"call_{i}", call["name"], args))
    rest = _TOOL_CALL.sub("", text)
    if "<tool_call>" in rest:
        errors.append("malformed tool call: <tool_call> without </tool_call>")
        rest = rest.split("<tool_call>", 1)[0]
    return rest.strip(), calls, errors


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, answer) of a turn that opens with <think>...</think>; (None, text) else."""
    m = _THINK.match(text)
    if not m:
        return None, text
    return m.group(1).strip(), text[m.end() :]
