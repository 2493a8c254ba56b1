"""Arithmetic with a calculator tool: RL teaches a policy to use the tool its teacher used
sloppily.

    prompt   "37*48="
    turn 1   <tool_call>{"name":"calc","arguments":{"expr":"37*48"}}</tool_call>
    obs      \\n<tool_response>\\n1776\\n</tool_response>\\n     (in the run's chat format)
    turn 2   1776                                              -> reward 1

Problems are `a*b` (two-digit operands by default): a tiny model cannot multiply them in
its head, but it can copy the operands into a call and the result into its answer. The
reward is 1 when the answer's leading integer is the product, else 0 (the first turn
without a tool call is the answer).

The SFT teacher (`demonstrations`) is sloppy with the tool: it calls it correctly in a
`tool_rate` share of problems (default 0.3), writes a malformed call in `broken_rate`
(0.2; the error observation, then a guess), and otherwise guesses without the tool
(the product off by 1..99: a plausible wrong answer). Imitating it gives a policy that
uses the tool about a third of the time; RL against the exact reward has to make the
call a habit. Held-out problems (`eval_size`, their own seed label) never appear in
training.

The calculator (bridge/tools/calculator.py) evaluates + - * // % and parentheses over
integers (an AST walk, no eval), in the sandbox like any tool.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from bridge.tasks.arithmetic import leading_int
from bridge.tasks.env import register_env
from bridge.tasks.tool_calls import CLOSE, OPEN, parse_tool_calls
from bridge.tasks.tool_env import Tool, ToolEnvironment
from bridge.tools.calculator import calculator

CALC = Tool(
    "bridge.tools.calculator:calculator",
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an integer arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expr": {"type": "string", "description": "e.g. 37*48"}},
                "required": ["expr"],
            },
        },
    },
)


def call_text(expr: str) -> str:
    """The teacher's call: Qwen3's tool-call format, compact (short for a tiny model)."""
    return f'{OPEN}{{"name":"calc","arguments":{{"expr":"{expr}"}}}}{CLOSE}'


@register_env("tool_arith", max_turns=3, turn_max_tokens=72)
class ToolArith(ToolEnvironment):
    tools = (CALC,)

    def __init__(
        self,
        digits: int = 2,
        tool_rate: float = 0.3,
        broken_rate: float = 0.2,
        **sandbox_and_format,
    ):
        super().__init__(**sandbox_and_format)
        if not 1 <= int(digits) <= 4:
            raise ValueError(f"digits must be in 1..4, got {digits}")
        if not (0 <= tool_rate and 0 <= broken_rate and tool_rate + broken_rate <= 1):
            raise ValueError(
                f"need tool_rate, broken_rate >= 0 summing to <= 1, got {tool_rate}, {broken_rate}"
            )
        self.digits, self.tool_rate, self.broken_rate = (
            int(digits),
            float(tool_rate),
            float(broken_rate),
        )

    def _problem(self, seed: int) -> tuple[int, int]:
        rng = random.Random(seed)
        lo, hi = 10 ** (self.digits - 1), 10**self.digits - 1
        return rng.randint(lo, hi), rng.randint(lo, hi)

    def question(self, seed: int) -> str:
        a, b = self._problem(seed)
        self.answer = a * b
        return f"{a}*{b}="

    def score(self, answer: str) -> float:
        return 1.0 if leading_int(answer) == self.answer else 0.0

    def demonstrations(self, seed: int) -> Iterator[tuple[str, str]]:
        """(context so far, the teacher's next turn), both turns of each episode; a later
        turn's context joins the earlier turns with the end-of-turn token the engine stops
        on, so SFT sees the tokens an episode has (module docstring: the sloppy teacher)."""
        rng = random.Random(f"tool_arith/sft/{seed}")
        eot = self.turns.end_of_turn
        while True:
            q = self.reset(rng.randrange(1 << 62))
            a, b = self._problem(self.seed)
            u = rng.random()
            guess = str(a * b + rng.choice((-1, 1)) * rng.randint(1, 99))
            if u < self.tool_rate + self.broken_rate:
                call = call_text(f"{a}*{b}")
                if u >= self.tool_rate:  # a sloppy call: the closing brace forgotten
                    call = call.replace("}}" + CLOSE, "}" + CLOSE)
                # What the environment answers, without a sandbox round trip per example.
                result = calculator(f"{a}*{b}") if u < self.tool_rate else None
                obs = self.turns.tool_results([result or self.call(parse_tool_calls(call)[0])])
                yield q, call
                yield q + call + eot + obs, str(a * b) if u < self.tool_rate else guess
            else:
                yield q, guess
