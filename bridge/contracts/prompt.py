"""Prompt token ids, the one encoding both stacks use, in one of two formats.

- plain: BOS (if the tokenizer has one), then the prompt text encoded without special
  tokens (what the tiny character-level models are trained on).
- chat: the tokenizer's own chat template rendered for one user turn (after an optional
  system message) with the generation prompt, then encoded without special tokens. This
  is `transformers`' `apply_chat_template(messages, add_generation_prompt=True,
  tokenize=True)`: the same Jinja environment (sandboxed, trim_blocks, lstrip_blocks,
  loopcontrols, tojson, raise_exception, strftime_now), the tokenizer's special tokens
  passed to the template, no BOS added by us (a template that wants one writes it).
  `thinking` sets the template's `enable_thinking` (Qwen3's switch): "on"/"off", or ""
  to leave it undefined (the template's default; Qwen3 thinks by default).

The controller (trusted side) builds every prompt's ids with `TextCodec` (the `tokenizers`
library on the HF directory's tokenizer.json) and sends them in the lease
(bridge/control/leasing/lease_content.py): workers never tokenize a prompt. The learner encodes
with the same codec (SFT, evaluation). `rollout_gpu/generate.py prompt_token_ids` runs the
same `format_prompt_ids` on an HF tokenizer; tests/bridge/contracts/prompt_format_test.py
uses it to show that transformers' tokenizer gives the same ids. Jinja2 is rendered
directly (as transformers does), so bridge imports neither torch nor transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime

FORMATS = ("plain", "chat")
THINKING = ("", "on", "off")
CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers' separate file; wins over the config
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclasses.dataclass(frozen=True)
class PromptFormat:
    """How a task's prompt text becomes the model's prompt (task or config data)."""

    kind: str = "plain"  # plain | chat
    system: str = ""  # chat: a system message before the user turn ('' = none)
    thinking: str = ""  # chat: '' (template default) | 'on' | 'off' -> enable_thinking
    # chat: the tools the template declares (its `tools=`), a JSON array of function
    # schemas as text (hashable, and as it travels); '' = none.
    tools: str = ""

    def __post_init__(self):
        if self.kind not in FORMATS:
            raise ValueError(f"prompt format must be one of {FORMATS}, got {self.kind!r}")
        if self.thinking not in THINKING:
            raise ValueError(f"prompt thinking must be one of {THINKING}, got {self.thinking!r}")
        if self.tools and not isinstance(self.tool_list(), list):
            raise ValueError(f"prompt tools must be a JSON array of schemas, got {self.tools!r}")
        if self.kind == "plain" and (self.system or self.thinking or self.tools):
            raise ValueError(
                "a system prompt, the thinking switch and tools need the chat format "
                f"(prompt format 'chat'), got format {self.kind!r}"
            )

    def messages(self, text: str) -> list[dict[str, str]]:
        """The chat: optional system message, then the prompt as the user's turn."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": "user", "content": text}]

    def tool_list(self) -> list | None:
        return json.loads(self.tools) if self.tools else None

    def template_kwargs(self) -> dict:
        return {} if not self.thinking else {"enable_thinking": self.thinking == "on"}


def prompt_ids(bos_id: int | None, text_ids: Sequence[int]) -> list[int]:
    """Plain format: BOS (if any) followed by the text's ids."""
    return ([bos_id] if bos_id is not None else []) + [int(t) for t in text_ids]


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    """The template in transformers' Jinja environment (utils/chat_template_utils.py)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson HTML-escapes; chat templates expect plain JSON.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_chat(
    template: str, text: str, fmt: PromptFormat, special_tokens: Mapping[str, str]
) -> str:
    """The chat template rendered for `text` with the generation prompt."""
    kwargs = {k: v for k, v in special_tokens.items() if v is not None}
    return _compile(template).render(
        messages=fmt.messages(text),
        tools=fmt.tool_list(),
        documents=None,
        add_generation_prompt=True,
        **kwargs,
        **fmt.template_kwargs(),
    )


def format_prompt_ids(
    text: str,
    fmt: PromptFormat,
    encode: Callable[[str], Sequence[int]],
    bos_id: int | None,
    chat_template: str | None,
    special_tokens: Mapping[str, str],
) -> list[int]:
    """The contract: a task's prompt text -> the prompt token ids the model sees.

    `encode(s)` must tokenize without adding special tokens (added tokens written in the
    text, such as <|im_start|>, still become their ids: both libraries split them out)."""
    if fmt.kind == "plain":
        return prompt_ids(bos_id, encode(text))
    if not chat_template:
        raise ValueError("prompt format 'chat' needs a tokenizer with a chat template")
    return [int(t) for t in encode(render_chat(chat_template, text, fmt, special_tokens))]


def read_chat_template(hf_dir: str) -> str | None:
    """The directory's chat template as transformers finds it: chat_template.jinja first,
    else tokenizer_config.json's "chat_template" (a string; a named list takes "default")."""
    path = os.path.join(hf_dir, CHAT_TEMPLATE_FILE)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    path = os.path.join(hf_dir, "tokenizer_config.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        template = json.load(f).get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class TextCodec:
    """Tokenizer of an HF dir: text -> ids, prompt text -> prompt ids (`fmt`), EOS/PAD ids."""

    def __init__(self, hf_dir: str, fmt: PromptFormat = PromptFormat()):
        from tokenizers import Tokenizer

        path = os.path.join(hf_dir, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{hf_dir} has no tokenizer.json")
        self.tok = Tokenizer.from_file(path)
        self.fmt = fmt
        special = {}
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            p = os.path.join(hf_dir, name)
            if os.path.exists(p):
                with open(p) as f:
                    data = json.load(f)
                for k in set(_SPECIAL_KEYS) & set(data):  # a dict is an AddedToken's fields
                    v = data[k]
                    special.setdefault(k, v.get("content") if isinstance(v, dict) else v)
        self.special_tokens = {k: special[k] for k in _SPECIAL_KEYS if special.get(k) is not None}
        self.eos_id = self._id(special.get("eos_token"))
        self.bos_id = self._id(special.get("bos_token"))
        pad = self._id(special.get("pad_token"))
        self.pad_id = pad if pad is not None else self.eos_id
        if self.eos_id is None:
            raise ValueError(f"{hf_dir}: tokenizer config names no eos_token")
        self.chat_template = read_chat_template(hf_dir)
        if fmt.kind == "chat" and not self.chat_template:
            raise ValueError(
                f"prompt format 'chat' but {hf_dir} has no chat template (neither "
                f"{CHAT_TEMPLATE_FILE} nor tokenizer_config.json's chat_template); "
                "use the plain format or a tokenizer that has one"
            )

    def _id(self, token):
        return None if token is None else self.tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """Prompt ids in this codec's format (`format_prompt_ids`): what a lease carries."""
        return format_prompt_ids(
            text, self.fmt, self.encode, self.bos_id, self.chat_template, self.special_tokens
        )

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)
