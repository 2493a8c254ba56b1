"""reasoning-gym tasks: any of its ~100 procedural datasets by name (no files, no downloads).

    make_task("reasoning_gym", dataset="chain_sum", dataset_options={"max_terms": 3})
    # config: task.name="reasoning_gym", task.dataset="chain_sum",
    #         task.dataset_options='{"max_terms": 3}'   (a dict or its JSON string)

Items. reasoning-gym generates item `i` of a dataset built with seed `s` from `s + i`, so
datasets with nearby seeds share items. Every split therefore starts at a seed derived by
SHA-256 from its own label (`train/<seed>`, `eval`), 2**31 values apart on average, and walks
forward in chunks of `CHUNK` items (chunk c is `create_dataset(name, seed=base + c * CHUNK,
size=CHUNK)`), so one stream never repeats an item. The held-out split is the first
`eval_size` items from the "eval" seed; the training stream skips any item whose question
text is held out, which makes the splits disjoint even where the problem space is small.

Prompt ids: `reasoning_gym/<dataset>/<split>/<seed>/<index>/<options JSON>`, everything
needed to regenerate the item, so the trusted side rebuilds it (question, answer, metadata)
from the id alone with `entry_from_id` / `prompt_from_id`, and `reward` scores against the
rebuilt entry, never against an answer that travelled with the prompt.

Scoring. The completion's answer is the last `<answer>...</answer>` (reasoning-gym's own
`extract_answer`, stripped), or the whole stripped completion when it has no such tag.
- `scoring="strict"` (default): 1.0 when the answer equals the reference exactly, or when
  the dataset's own scorer gives it full credit, else 0.0. Never partial credit: the base
  scorer gives `len(ref) / len(answer)` to any answer containing the reference ("17" earns
  0.5 against "7"), which pays a policy for padding guesses around the right digits. Full
  credit from the dataset's scorer is kept because several datasets have many correct
  answers (countdown's expressions, graph_color's colourings, rush_hour's move lists; five
  have no single reference at all) or accept equal forms ("7.0" for "7"); exact string
  match alone would score those 0 for right answers. A scorer that raises scores 0.0.
- `scoring="exact"`: the exact match only (a scorer-free check; wrong for those datasets).
- `scoring="dataset"`: reasoning-gym's `score_answer` as is, partial credit included.
Scoring runs inline: reasoning-gym's scorers are string checks; the pool-based override
options of `user_reward` (reward_fn, reward_timeout_s) apply here as to any task.

SFT examples are (prompt, "<answer>{answer}</answer>") for items with a reference answer.
`sft_label_noise` makes that teacher sloppy, as in the arithmetic task: that fraction of the
SFT answers has its first two characters swapped ("grub" -> "rgub"). Above 0.5 the swap is
the teacher's most common answer, so an imitating policy learns the task and the habit (it
must know the right letters to swap them) and RL against the exact reward has to unlearn
the habit. Prompts, rewards and the held-out set stay exact.
reasoning-gym is an optional extra, imported on first use, not when bridge.tasks is.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from collections.abc import Iterator
from typing import Any

from bridge.tasks.base import Prompt, RewardError, Task
from bridge.tasks.registry import register_task

CHUNK = 500  # items per generated dataset object (its `size`); part of every prompt id's meaning
DEFAULT_TEMPLATE = "{question}\n\nGive only your final answer, as <answer>...</answer>."
SCORINGS = ("strict", "exact", "dataset")
_PREFIX = "reasoning_gym"


@functools.cache
def _rg():
    try:
        import reasoning_gym
        import reasoning_gym.factory
        import reasoning_gym.utils
    except ImportError as e:
        raise ImportError(
            "the reasoning_gym task needs reasoning-gym: pip install 'reasoning-gym>=0.1.25' "
            "(or the echo2 'tasks' extra)"
        ) from e
    return reasoning_gym


def canonical_options(options: dict[str, Any] | str | None) -> str:
    """Dataset options as the canonical JSON text that prompt ids carry."""
    if isinstance(options, str):
        try:
            options = json.loads(options) if options.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"dataset_options is not JSON: {options!r}: {e}") from e
    options = dict(options or {})
    for reserved in ("seed", "size"):
        if reserved in options:
            raise ValueError(f"dataset_options may not set {reserved!r}: the splits choose it")
    return json.dumps(options, sort_keys=True, separators=(",", ":"))


def split_seed(label: str) -> int:
    """A split's first seed: far from every other split's (reasoning-gym wraps at 2**32)."""
    return int.from_bytes(hashlib.sha256(label.encode()).digest()[:4], "big") % 2**31


@functools.lru_cache(maxsize=256)
def _dataset(name: str, options_json: str, seed: int):
    return _rg().create_dataset(name, seed=seed, size=CHUNK, **json.loads(options_json))


def make_prompt_id(name: str, split: str, seed: int, index: int, options_json: str) -> str:
    return f"{_PREFIX}/{name}/{split}/{seed}/{index}/{options_json}"


def parse_prompt_id(prompt_id: str) -> tuple[str, str, int, int, str]:
    """(dataset, split, seed, index, options JSON) of a reasoning_gym prompt id."""
    parts = prompt_id.split("/", 5)
    try:
        if len(parts) != 6 or parts[0] != _PREFIX:
            raise ValueError("wrong shape")
        _, name, split, seed, index, options_json = parts
        seed_i, index_i = int(seed), int(index)
        if not 0 <= index_i < CHUNK:
            raise ValueError(f"index out of range [0, {CHUNK})")
        if canonical_options(options_json) != options_json:
            raise ValueError("options are not canonical JSON")
    except ValueError as e:
        raise ValueError(f"not a reasoning_gym prompt id: {prompt_id!r} ({e})") from e
    return name, split, seed_i, index_i, options_json


def entry_from_id(prompt_id: str) -> dict[str, Any]:
    """The reasoning-gym item ({"question", "answer", "metadata"}) a prompt id names."""
    name, _, seed, index, options_json = parse_prompt_id(prompt_id)
    return _dataset(name, options_json, seed)[index]


def _prompt(prompt_id: str, entry: dict[str, Any], template: str) -> Prompt:
    answer = "" if entry["answer"] is None else str(entry["answer"])
    # str.replace, not format: templates and questions may hold other braces.
    return Prompt(prompt_id, template.replace("{question}", entry["question"]), answer)


def prompt_from_id(prompt_id: str, template: str = DEFAULT_TEMPLATE) -> Prompt:
    """The Prompt a prompt id names, rebuilt from the id alone (the task's `template`)."""
    return _prompt(prompt_id, entry_from_id(prompt_id), template)


def extract_answer(completion: str) -> str:
    """The last <answer>...</answer>, stripped; the stripped completion when there is none."""
    found = _rg().utils.extract_answer(completion, tag_name="answer", strip=True)
    return completion.strip() if found is None else found


@register_task(_PREFIX)
class ReasoningGym(Task):
    def __init__(
        self,
        dataset: str,
        dataset_options: dict[str, Any] | str | None = None,
        scoring: str = "strict",
        eval_size: int = 200,
        template: str = DEFAULT_TEMPLATE,
        sft_label_noise: float = 0.0,
    ):
        if not 0.0 <= sft_label_noise <= 1.0:
            raise ValueError(f"sft_label_noise must be in [0, 1], got {sft_label_noise}")
        self.sft_label_noise = float(sft_label_noise)
        if scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
        if "{question}" not in template:
            raise ValueError(f"template must contain {{question}}: {template!r}")
        self.dataset, self.options_json = dataset, canonical_options(dataset_options)
        self.scoring, self.eval_size, self.template = scoring, int(eval_size), template
        datasets = _rg().factory.DATASETS
        if dataset not in datasets:
            raise ValueError(
                f"unknown reasoning-gym dataset {dataset!r}; known: {sorted(datasets)}"
            )
        try:  # bad options fail here, when the task is built, not mid-run
            _dataset(dataset, self.options_json, split_seed("eval"))
        except Exception as e:
            raise ValueError(f"reasoning-gym {dataset!r} rejects {self.options_json}: {e}") from e
        self._eval: list[tuple[Prompt, dict]] | None = None

    def _items(self, split: str, label: str) -> Iterator[tuple[Prompt, dict]]:
        base = split_seed(label)
        for chunk in range(2**32 // CHUNK):
            seed = (base + chunk * CHUNK) % 2**32
            ds = _dataset(self.dataset, self.options_json, seed)
            for i in range(CHUNK):
                entry = ds[i]
                pid = make_prompt_id(self.dataset, split, seed, i, self.options_json)
                yield _prompt(pid, entry, self.template), entry

    def _held_out(self) -> list[tuple[Prompt, dict]]:
        if self._eval is None:
            items = self._items("eval", "eval")
            self._eval = [next(items) for _ in range(self.eval_size)]
        return self._eval

    def _train(self, seed: int) -> Iterator[tuple[Prompt, dict]]:
        held = {entry["question"] for _, entry in self._held_out()}
        for prompt, entry in self._items("train", f"train/{seed}"):
            if entry["question"] not in held:
                yield prompt, entry

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        return (prompt for prompt, _ in self._train(seed))

    def eval_prompts(self) -> list[Prompt]:
        return [prompt for prompt, _ in self._held_out()]

    def sft_examples(self, seed: int) -> Iterator[tuple[str, str]]:
        noise = random.Random(f"sft-label-noise/{seed}")  # independent of the item stream
        for prompt, entry in self._train(seed):
            if entry["answer"] is not None:
                answer = str(entry["answer"])
                if noise.random() < self.sft_label_noise:
                    answer = answer[1::-1] + answer[2:]  # the sloppy teacher's habit
                yield prompt.text, f"<answer>{answer}</answer>"

    def prompt_from_id(self, prompt_id: str) -> Prompt:
        return prompt_from_id(prompt_id, self.template)

    def reward(self, prompt: Prompt, completion: str) -> float:
        name, _, seed, index, options_json = parse_prompt_id(prompt.prompt_id)
        if (name, options_json) != (self.dataset, self.options_json):
            raise RewardError(
                f"prompt {prompt.prompt_id!r} is not from this task "
                f"({self.dataset} with {self.options_json})"
            )
        ds = _dataset(name, options_json, seed)
        entry = ds[index]  # the trusted reference, rebuilt; never prompt.answer
        answer = extract_answer(completion)
        scorer = ds.score_answer
        if self.scoring == "dataset":
            return float(scorer(answer, entry))
        if entry["answer"] is not None and answer == str(entry["answer"]).strip():
            return 1.0
        if self.scoring == "exact":
            return 0.0
        try:
            return 1.0 if float(scorer(answer, entry)) >= 1.0 else 0.0
        except Exception:  # noqa: BLE001 - an answer the scorer cannot even read is wrong
            return 0.0
