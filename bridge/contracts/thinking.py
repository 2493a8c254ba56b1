"""Reasoning models: `task.thinking` and the answer a reward sees.

`task.thinking` is `auto` (the chat template's default: Qwen3's hybrid template thinks
unless told otherwise), `on` or `off`; on/off become the template's `enable_thinking`
(PromptFormat.thinking, passed to the template as transformers' `apply_chat_template(...,
enable_thinking=...)` does). With `off` Qwen3's template closes an empty think block in
the prompt itself ("<think>\\n\\n</think>\\n\\n"), so the completion is the answer.

Scoring (`split`) applies whenever the run renders a chat template that knows `</think>`
(in every mode: a model told not to think may still open a block): only the text after
the last `</think>` is the answer, so an answer written inside the thinking earns nothing,
and a completion whose think block never closes has no answer at all (scored 0, as a
truncated answer would be). A prompt that itself ends inside an open `<think>` (templates
of thinking-only models such as Qwen3-2507 add "<think>\\n" to the generation prompt) makes
the completion start inside the block (`opened`). Templates without `</think>` (the plain
format, the tiny character-level models) are scored on the whole text, as before.
"""

from __future__ import annotations

import dataclasses

MODES = ("auto", "on", "off")
OPEN, CLOSE = "<think>", "</think>"


def prompt_thinking(mode: str) -> str:
    """`task.thinking` -> PromptFormat.thinking ('' = the template's default)."""
    if mode not in MODES:
        raise ValueError(f"task.thinking must be one of {MODES}, got {mode!r}")
    return "" if mode == "auto" else mode


def template_thinks(template: str | None) -> bool:
    """Does this chat template know think blocks (Qwen3, DeepSeek-R1 style)?"""
    return bool(template) and CLOSE in template


def scores_after_think(fmt, template: str | None) -> bool:
    """Whether completions of a run with PromptFormat `fmt` are scored after `</think>`."""
    return getattr(fmt, "kind", "plain") == "chat" and template_thinks(template)


def opens_thinking(prompt_text: str) -> bool:
    """The rendered prompt ends inside a think block (an `<think>` after the last `</think>`)."""
    return prompt_text.rfind(OPEN) > prompt_text.rfind(CLOSE)


@dataclasses.dataclass(frozen=True)
class Split:
    """A completion cut at its last `</think>`: `answer` None when a block never closed;
    `closed` whether a `</think>` was found."""

    thinking: str
    answer: str | None
    closed: bool = False

    @property
    def terminated(self) -> bool:
        return self.answer is not None


def split(text: str, opened: bool = False) -> Split:
    """The thinking and the answer of one completion text (module docstring)."""
    end = text.rfind(CLOSE)
    if end >= 0:
        return Split(text[:end], text[end + len(CLOSE) :], closed=True)
    if opened or OPEN in text:
        return Split(text, None)  # unterminated: no answer
    return Split("", text)


def think_tokens(ids, parts: Split, close_id: int | None = None, encode=None) -> int:
    """How many completion tokens the thinking took (the closing tag included): every token
    when the block never closed; up to the last `close_id` when `</think>` is one token
    (Qwen3); else the thinking text re-encoded with `encode`."""
    ids = [int(i) for i in ids]
    if not parts.terminated:
        return len(ids)
    if not parts.closed:
        return 0
    if close_id is not None and close_id in ids:
        return len(ids) - ids[::-1].index(close_id)
    return len(encode(parts.thinking + CLOSE)) if encode is not None else 0
