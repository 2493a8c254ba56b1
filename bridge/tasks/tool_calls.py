"""Tool calls in the Qwen3 / Hermes format: `<tool_call>{json}</tool_call>` in a model turn.

    calls = parse_tool_calls(turn_text)   # [ToolCall | MalformedCall, ...] in order

Qwen3's chat template tells the model (when `tools=` are declared) to answer each call as

    <tool_call>
    {"name": <function-name>, "arguments": <args-json-object>}
    </tool_call>

and renders an assistant message's `tool_calls` back the same way. A call is one such
block after the turn's reasoning (text before the last `</think>` is the model thinking
about calls, not making them). Whitespace inside the tags is free. `arguments` may be an
object or a JSON string holding one (the template writes a string verbatim).

A block that is not a call (no closing tag, not JSON, not an object with a string `name`
and object `arguments`) is a `MalformedCall` that says why in words the model can read:
the environment answers it as an observation, it never raises.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
THINK_CLOSE = "</think>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class MalformedCall:
    text: str  # the block as written (inside the tags, or to the end of the turn)
    error: str  # why it is no call, for the model to read


def _call(body: str) -> ToolCall | MalformedCall:
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        return MalformedCall(body, f"not JSON ({e.msg} at char {e.pos})")
    if not isinstance(data, dict):
        return MalformedCall(body, f"a call is a JSON object, got {type(data).__name__}")
    name, args = data.get("name"), data.get("arguments", {})
    if not isinstance(name, str) or not name:
        return MalformedCall(body, 'no "name" string')
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return MalformedCall(body, '"arguments" is a string that is not JSON')
    if not isinstance(args, dict):
        return MalformedCall(body, '"arguments" must be a JSON object')
    return ToolCall(name, args)


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall]:
    """Every `<tool_call>` block after the turn's last `</think>`, in order."""
    answer = text.rsplit(THINK_CLOSE, 1)[-1]
    out: list[ToolCall | MalformedCall] = []
    pos = answer.find(OPEN)
    while pos >= 0:
        start = pos + len(OPEN)
        end = answer.find(CLOSE, start)
        if end < 0:
            out.append(MalformedCall(answer[start:], f"no closing {CLOSE}"))
            break
        out.append(_call(answer[start:end].strip()))
        pos = answer.find(OPEN, end + len(CLOSE))
    return out


def format_call(call: ToolCall) -> str:
    """A call as Qwen3's template renders an assistant's `tool_calls` entry."""
    return f'{OPEN}\n{{"name": "{call.name}", "arguments": {json.dumps(call.arguments)}}}\n{CLOSE}'
