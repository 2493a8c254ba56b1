"""GSM8K task adapter: reads a local JSONL of {"question", "answer"}; never downloads.

    make_task("gsm8k", path="/data/gsm8k/train.jsonl", eval_path="/data/gsm8k/test.jsonl")

The reference answer is the number after GSM8K's final `#### ` marker (commas removed).
A completion is scored 1.0 when its final answer equals the reference, else 0.0. With
`answer_check="math_verify"` (the default) math-verify finds and compares the answer
(`\\boxed{}`, LaTeX fractions, "1,000", "x = 5", the last number...), in the reward pool
under a timeout; when the completion writes GSM8K's `####`, only the rest of the line after
the last one counts. `answer_check="final_number"` is the hand-written check without the extra
dependency: the final number (after `####` if present, else the last one) compared as a
float. The two agree on plain numeric answers (the tests check both); math-verify also
accepts equivalent forms such as `\\frac{25}{2}` for 12.5. Without `eval_path`
every `eval_every`-th line of `path` is held out and never trained on. Files are read on
first use, so a rollout worker can build the task just to score rewards.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
from collections.abc import Iterator

from bridge.tasks import math_reward, reward_pool
from bridge.tasks.base import Prompt, Task
from bridge.tasks.registry import register_task

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    """The number a solution ends on: after the last '####' if present, else the last one."""
    if "####" in text:
        found = _NUMBER.findall(text.rsplit("####", 1)[1])
        return _normalize(found[0]) if found else None
    found = _NUMBER.findall(text)
    return _normalize(found[-1]) if found else None


def _normalize(num: str) -> str:
    num = num.replace(",", "").rstrip(".")
    if "." in num:
        num = num.rstrip("0").rstrip(".")
    return num


def _read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from e
            if not isinstance(row.get("question"), str) or not isinstance(row.get("answer"), str):
                raise ValueError(f"{path}:{lineno}: needs string fields 'question' and 'answer'")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no examples")
    return rows


@register_task("gsm8k")
class GSM8K(Task):
    def __init__(
        self,
        path: str,
        eval_path: str | None = None,
        eval_every: int = 10,
        eval_size: int | None = None,
        template: str = "Question: {question}\nAnswer:",
        answer_check: str = "math_verify",
    ):
        if answer_check not in ("math_verify", "final_number"):
            raise ValueError(f"answer_check must be math_verify or final_number: {answer_check!r}")
        if answer_check == "math_verify" and importlib.util.find_spec("math_verify") is None:
            raise ImportError(
                "gsm8k checks answers with math-verify: pip install 'math-verify>=0.9', "
                "or build the task with answer_check='final_number'"
            )
        self.answer_check = answer_check
        self.path, self.eval_path, self.eval_every = path, eval_path, eval_every
        self.eval_size, self.template = eval_size, template
        self._splits = None  # read on first use: a worker scoring rewards needs no data file

    def _load(self):
        if self._splits is not None:
            return self._splits
        path, eval_path, eval_every = self.path, self.eval_path, self.eval_every
        examples = [self._example(r, path, i) for i, r in enumerate(_read_jsonl(path))]
        if eval_path:
            train = examples
            evals = [self._example(r, eval_path, i) for i, r in enumerate(_read_jsonl(eval_path))]
        else:
            train = [e for i, e in enumerate(examples) if i % eval_every != 0]
            evals = [e for i, e in enumerate(examples) if i % eval_every == 0]
        if self.eval_size is not None:
            evals = evals[: self.eval_size]
        if not train:
            raise ValueError(f"{path}: no training examples left after the held-out split")
        self._splits = train, evals
        return self._splits

    def _example(self, row: dict, path: str, i: int) -> tuple[int, str, str, str]:
        ref = final_number(row["answer"])
        if ref is None:
            raise ValueError(f"{path}: example {i} has no final number in its answer")
        return i, self.template.format(question=row["question"]), ref, row["answer"]

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        # Endless epochs, each a fresh seeded shuffle; ids name the line so repeats are visible.
        train = self._load()[0]
        rng, order = random.Random(seed), list(range(len(train)))
        while True:
            rng.shuffle(order)
            for k in order:
                i, text, ref, _ = train[k]
                yield Prompt(f"gsm8k/train/{i}", text, ref)

    def eval_prompts(self) -> list[Prompt]:
        return [Prompt(f"gsm8k/eval/{i}", text, ref) for i, text, ref, _ in self._load()[1]]

    def reward(self, prompt: Prompt, completion: str) -> float:
        if self.answer_check == "math_verify":
            text = completion
            if "####" in completion:  # GSM8K's marker: its answer is the rest of that line
                text = completion.rsplit("####", 1)[1].lstrip().split("\n", 1)[0]
            return reward_pool.guarded_call(
                math_reward.math_verify_score,
                prompt.answer,
                text,
                timeout_s=reward_pool.DEFAULT_TIMEOUT_S,
            )
        got = final_number(completion)
        if got is None:
            return 0.0
        try:
            return 1.0 if float(got) == float(prompt.answer) else 0.0
        except ValueError:
            return 0.0

    def sft_examples(self, seed: int) -> Iterator[tuple[str, str]]:
        train = self._load()[0]
        rng, order = random.Random(seed), list(range(len(train)))
        while True:
            rng.shuffle(order)
            for k in order:
                _, text, _, solution = train[k]
                yield text, " " + solution
