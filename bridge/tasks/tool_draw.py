"""A task whose tool is not deterministic: the model draws a random number and adds to it.

    prompt   "draw+17="
    turn 1   <tool_call>{"name":"draw","arguments":{}}</tool_call>
    obs      \\n<tool_response>\\n57\\n</tool_response>\\n     (a fresh draw: 1..100)
    turn 2   74                                                -> reward 1

No replay can recompute the draw, so the environment is not deterministic
(`Tool(..., deterministic=False)`, bridge/tasks/tool_env.py): its lease carries no seed,
every call goes to the controller (POST /v1/episode), which draws, records the result and
scores the answer against the draw it recorded. It is the demonstration of that mode
(tests/bridge/control/intake/tool_replay_test.py); a clock or a web lookup is the same
case. The reward is 1 when the answer's leading integer is the last draw plus the
question's addend, else 0 (the first turn without a tool call is the answer).
"""

from __future__ import annotations

import random

from bridge.tasks.arithmetic import leading_int
from bridge.tasks.env import register_env
from bridge.tasks.tool_calls import CLOSE, OPEN
from bridge.tasks.tool_env import Tool, ToolEnvironment

DRAW = Tool(
    "bridge.tools.draw:draw",
    {
        "type": "function",
        "function": {
            "name": "draw",
            "description": "A fresh random integer from 1 to sides (default 100).",
            "parameters": {
                "type": "object",
                "properties": {"sides": {"type": "integer", "description": "e.g. 100"}},
                "required": [],
            },
        },
    },
    deterministic=False,
)
DRAW_CALL = f'{OPEN}{{"name":"draw","arguments":{{}}}}{CLOSE}'


@register_env("tool_draw", max_turns=3, turn_max_tokens=72)
class ToolDraw(ToolEnvironment):
    tools = (DRAW,)

    def question(self, seed: int) -> str:
        self.addend = random.Random(seed).randint(1, 99)
        return f"draw+{self.addend}="

    def score(self, answer: str) -> float:
        if not self.results:
            return 0.0  # no draw: nothing to add to
        last = leading_int(self.results[-1])
        return 1.0 if last is not None and leading_int(answer) == last + self.addend else 0.0
