"""Synthetic 2-digit arithmetic, the demo's default task (no files, no downloads).

Prompts stay short printable ASCII because the tiny demo model's tokenizer is
character-level.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator

from bridge.tasks.base import Prompt, Task
from bridge.tasks.registry import register_task

_LEADING_INT = re.compile(r"\s*(-?\d+)")


def leading_int(text: str) -> int | None:
    m = _LEADING_INT.match(text)
    return int(m.group(1)) if m else None


@register_task("arithmetic")
class Arithmetic(Task):
    """Seeded `a<op>b=` problems; the answer is the exact integer result.

    Knobs: `digits` (max digits per operand), `min_digits`, `ops` (subset of "+-*"),
    `allow_negative` (else a-b has a >= b), `eval_size`, `eval_every` (one problem in
    `eval_every` is held out, by a fixed hash of the problem, never trained on).
    Reward: 1.0 when the completion's leading integer equals the answer; otherwise
    `format_reward` (default 0.0) if it at least starts with an integer, else 0.0.
    With `strict=True` the whole stripped completion must equal the answer.

    `sft_label_noise` models a sloppy teacher for the SFT warm start: that fraction of the
    SFT targets overshoots by one (answer + 1). Above 0.5 the overshoot is the teacher's
    most common answer, so an imitating policy answers one too high while still computing
    the right result internally (it must, to overshoot it); RL against the exact reward has
    to unlearn the habit. It touches only `sft_examples`: prompts, rewards and the held-out
    set stay exact.
    """

    def __init__(
        self,
        digits: int = 2,
        min_digits: int = 1,
        ops: str = "+-",
        allow_negative: bool = False,
        eval_size: int = 200,
        eval_every: int = 10,
        format_reward: float = 0.0,
        strict: bool = False,
        sft_label_noise: float = 0.0,
    ):
        if not 1 <= min_digits <= digits <= 9:
            raise ValueError(f"need 1 <= min_digits <= digits <= 9, got {min_digits}, {digits}")
        if not ops or set(ops) - set("+-*"):
            raise ValueError(f"ops must be a non-empty subset of '+-*', got {ops!r}")
        if eval_every < 2:
            raise ValueError("eval_every must be >= 2 so some problems remain for training")
        self.digits, self.min_digits, self.ops = digits, min_digits, ops
        self.allow_negative, self.eval_size, self.eval_every = allow_negative, eval_size, eval_every
        self.format_reward, self.strict = float(format_reward), strict
        if not 0.0 <= sft_label_noise <= 1.0:
            raise ValueError(f"sft_label_noise must be in [0, 1], got {sft_label_noise}")
        self.sft_label_noise = float(sft_label_noise)

    def _problem(self, rng: random.Random) -> tuple[int, str, int]:
        lo = 0 if self.min_digits == 1 else 10 ** (self.min_digits - 1)
        a, b = rng.randint(lo, 10**self.digits - 1), rng.randint(lo, 10**self.digits - 1)
        op = rng.choice(self.ops)
        if op == "-" and not self.allow_negative and a < b:
            a, b = b, a
        return a, op, b

    def _held_out(self, a: int, op: str, b: int) -> bool:
        # A fixed arithmetic hash (not Python's salted hash()) so the split is stable.
        return (a * 1_000_003 + b * 7_919 + ord(op) * 104_729) % self.eval_every == 0

    @staticmethod
    def _prompt(split: str, i: int, a: int, op: str, b: int) -> Prompt:
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        return Prompt(f"arithmetic/{split}/{i}", f"{a}{op}{b}=", str(value))

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        rng, i = random.Random(seed), 0
        while True:
            a, op, b = self._problem(rng)
            if not self._held_out(a, op, b):
                yield self._prompt("train", i, a, op, b)
                i += 1

    def eval_prompts(self) -> list[Prompt]:
        rng, out, seen, tries = random.Random(-1), [], set(), 0
        # Small digit counts have few held-out problems; stop once the space is exhausted.
        while len(out) < self.eval_size and tries < 200 * self.eval_size:
            tries += 1
            a, op, b = self._problem(rng)
            if self._held_out(a, op, b) and (a, op, b) not in seen:
                seen.add((a, op, b))
                out.append(self._prompt("eval", len(out), a, op, b))
        return out

    def reward(self, prompt: Prompt, completion: str) -> float:
        if self.strict:
            return 1.0 if completion.strip() == prompt.answer else 0.0
        got = leading_int(completion)
        if got is None:
            return 0.0
        return 1.0 if got == int(prompt.answer) else self.format_reward

    def sft_examples(self, seed: int) -> Iterator[tuple[str, str]]:
        noise = random.Random(f"sft-label-noise/{seed}")  # independent of the problem stream
        for p in self.train_prompts(seed):
            answer = int(p.answer)
            if noise.random() < self.sft_label_noise:
                answer += 1
            yield p.text, str(answer)
