"""Standard benchmark files (`task.eval_file`): a local JSONL or Parquet in the common layouts,
scored with math-verify. Never downloads.

    task = make_task("eval_file", path="math500.jsonl")     # eval_prompts() = the file
    items = read_eval_file("aime24.parquet")                 # [EvalItem], for reports

Layouts (field names case-insensitive, the first present wins):
- question: `problem` (MATH-500, AIME) or `question` (GSM8K);
- reference: `answer` (MATH-500's final answer, AIME's integer, GSM8K's worked solution
  whose final number follows `#### `); without one, the last `\\boxed{...}` of `solution`;
- subject (optional, for per-subject tables): `subject` or `type` (MATH), `year` (AIME);
- id (optional): `unique_id`, `id`, else the row's index.

The prompt is the question followed by `instruction` (by default the usual "reason step by
step, answer in \\boxed{}" line). The reward is math-verify's equivalence of the
completion's final answer with the reference (`math_reward.math_verify_score`, under the
reward pool's guard as GSM8K's is); a completion that writes GSM8K's `#### ` marker is read
from that marker, as in gsm8k.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator

from bridge.tasks import math_reward, reward_pool
from bridge.tasks.base import Prompt, Task
from bridge.tasks.gsm8k import final_number
from bridge.tasks.registry import register_task

DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
_QUESTION = ("problem", "question")
_SUBJECT = ("subject", "type", "year")
_ID = ("unique_id", "id")


@dataclasses.dataclass(frozen=True)
class EvalItem:
    item_id: str
    question: str
    answer: str
    subject: str = ""


def _rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"eval file {path} does not exist")
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError("Parquet eval files need pyarrow (the 'tasks' extra)") from e
        return pq.read_table(path).to_pylist()
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}:{lineno}: a line must be a JSON object")
                rows.append(row)
    return rows


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in `text` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _first(row: dict, keys) -> object:
    lower = {str(k).lower(): v for k, v in row.items()}
    for k in keys:
        if lower.get(k) not in (None, ""):
            return lower[k]
    return None


def _reference(row: dict) -> str | None:
    lower = {str(k).lower(): v for k, v in row.items()}
    answer = lower.get("answer")
    if answer not in (None, ""):
        text = str(answer)
        if "####" in text:  # GSM8K: a worked solution ending in "#### <number>"
            return final_number(text)
        return text.strip()
    solution = lower.get("solution")
    return last_boxed(str(solution)) if solution else None


def read_eval_file(path: str) -> list[EvalItem]:
    """The file's items; ValueError naming the row when one has no question or reference."""
    items = []
    for i, row in enumerate(_rows(path)):
        question, ref = _first(row, _QUESTION), _reference(row)
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"{path}: row {i} has no 'problem' or 'question' text")
        if not ref:
            raise ValueError(f"{path}: row {i} has no 'answer' (nor a \\boxed{{}} solution)")
        subject, item_id = _first(row, _SUBJECT), _first(row, _ID)
        items.append(
            EvalItem(str(item_id if item_id is not None else i), question, ref, str(subject or ""))
        )
    if not items:
        raise ValueError(f"{path}: no rows")
    return items


def score_answer(reference: str, completion: str) -> float:
    """math-verify's verdict on a completion's final answer (GSM8K's `####` honoured)."""
    text = completion
    if "####" in completion:
        text = completion.rsplit("####", 1)[1].lstrip().split("\n", 1)[0]
    return reward_pool.guarded_call(
        math_reward.math_verify_score, reference, text, timeout_s=reward_pool.DEFAULT_TIMEOUT_S
    )


@register_task("eval_file")
class EvalFileTask(Task):
    """A benchmark file as an evaluation-only task: its rows are the held-out prompts."""

    name = "eval_file"

    def __init__(self, path: str, instruction: str = DEFAULT_INSTRUCTION):
        self.path, self.instruction = path, instruction
        self._items = None  # read on first use: a reward worker needs no data file

    def items(self) -> list[EvalItem]:
        if self._items is None:
            self._items = read_eval_file(self.path)
        return self._items

    def prompt_text(self, item: EvalItem) -> str:
        return f"{item.question}\n{self.instruction}" if self.instruction else item.question

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        raise ValueError(f"eval_file {self.path} is for evaluation only (no training prompts)")

    def eval_prompts(self) -> list[Prompt]:
        return [
            Prompt(f"eval_file/{it.item_id}", self.prompt_text(it), it.answer)
            for it in self.items()
        ]

    def subjects(self) -> dict[str, str]:
        """prompt_id -> subject ('' where the file has none)."""
        return {f"eval_file/{it.item_id}": it.subject for it in self.items()}

    def reward(self, prompt: Prompt, completion: str) -> float:
        return score_answer(prompt.answer, completion)
