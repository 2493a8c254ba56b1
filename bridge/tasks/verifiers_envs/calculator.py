"""Multi-turn tool use, in verifiers' v1 API: arithmetic with a calculator tool.

Each task asks for the value of an expression of small integers; the model may call
`calculate(expression)` (a `vf.Toolset` tool) any number of times and then answers with the
number. The reward (`@vf.reward correct`) is 1 when the last reply's last integer is the
value; `@vf.metric tool_calls` counts the tool results in the trace.
"""

from __future__ import annotations

import json
import random
import re

import verifiers.v1 as vf

from bridge.tools.calculator import calculator

SYSTEM_PROMPT = (
    "Answer arithmetic questions. You may call the calculate tool. "
    "End with the final answer as a number."
)


def evaluate(expression: str) -> int:
    """The value echo2's calculator tool gives (bridge/tools/calculator.py: integers and
    + - * // % over an AST walk, never Python's eval)."""
    return int(calculator(expression))


class CalculatorToolset(vf.Toolset):
    @vf.tool
    def calculate(self, expression: str) -> str:
        """Evaluate an integer expression with + - * // % and parentheses, e.g. "(12+7)*3"."""
        return str(evaluate(expression))


class CalculatorData(vf.TaskData):
    expression: str
    answer: int


class CalculatorTask(vf.Task[CalculatorData, vf.State, vf.TaskConfig]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [CalculatorToolset(vf.ToolsetConfig())]

    @vf.reward
    async def correct(self, task: CalculatorData, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply)
        return float(bool(numbers) and int(numbers[-1]) == task.answer)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class CalculatorConfig(vf.TasksetConfig):
    size: int = 64
    seed: int = 0
    max_operand: int = 99


class CalculatorTaskset(vf.Taskset[CalculatorTask, CalculatorConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for i in range(self.config.size):
            a, b, c = (rng.randint(2, self.config.max_operand) for _ in range(3))
            op1, op2 = rng.choice("+-*"), rng.choice("+-")
            expression = f"{a}{op1}{b}{op2}{c}"
            yield CalculatorTask(
                CalculatorData(
                    name=f"calc#{i}",
                    prompt=f"What is {expression}?",
                    system_prompt=SYSTEM_PROMPT,
                    expression=expression,
                    answer=evaluate(expression),
                ),
                self.config.task,
            )


def demonstration(task: CalculatorTask) -> list[str]:
    """A scripted player's model turns (echo2's warm start, not verifiers API): call the
    tool on the expression, then answer with its value."""
    call = json.dumps({"name": "calculate", "arguments": {"expression": task.data.expression}})
    return [f"<tool_call>\n{call}\n</tool_call>", str(task.data.answer)]


__all__ = ["CalculatorTaskset"]
