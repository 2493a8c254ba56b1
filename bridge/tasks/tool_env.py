"""Environments whose model calls tools: an episode of tool calls, their results, an answer.

    @register_env("tool_arith", max_turns=3, turn_max_tokens=72)
    class ToolArith(ToolEnvironment):
        tools = (Tool("bridge.tasks.tool_arith:calculator", {...schema...}),)
        def question(self, seed) -> str: ...
        def score(self, answer: str) -> float: ...

An episode: the question (the first observation); each model turn with tool calls
(`<tool_call>{json}</tool_call>`, bridge/tasks/tool_calls.py) gets their results as the
next observation, written in the model's chat format (`turns`: bridge/tasks/chat_turns.py);
the first turn without a call is the answer, scored by `score`, and ends the episode. A
malformed call, an unknown tool, bad arguments, or a tool stopped by the sandbox's limits
(bridge/tasks/sandbox.py) is answered with an `error: ...` result the model can read:
the episode goes on, nothing raises.

Tools run in the sandbox on whichever side plays the environment: on the worker when its
lease carries the seed, and again on the trusted side, which replays every episode from
the model's turns and refuses a trajectory whose tool results differ from its own
(bridge/control/intake/rewards.py). That is the deterministic-replay mode, right for a tool
that is a function of its arguments (a calculator, a code runner with a fixed input). A
tool whose answer the trusted side cannot recompute (the web, a clock, a judge) belongs
in the controller mode: declare it `Tool(..., deterministic=False)`; the environment is
then not deterministic, its lease carries no seed and every tool call goes to the
controller (POST /v1/episode, bridge/control/intake/episode_steps.py), which runs it and
records the results (`drawn`: each turn's call results). Every later replay of the
episode (the next turn's, the submission's scoring) takes the recorded results back
(`redraw`) instead of calling the tool again, so the score sees what the model saw
(`results`: every result of the episode so far). A tool stopped at its wall-clock limit is the one
nondeterministic outcome of a deterministic tool (a loaded machine); its limits should
sit far from what an honest call needs.

Options (task options that go to the environment): `turns` ("plain" | "qwen3" |
"llama3"), `thinking` (the template's enable_thinking, "" | "on" | "off": the run's
`task.thinking`, set by learner_jax/train.py), `cpu_s`, `wall_s`, `memory_mb` (the sandbox
limits per call).
"""

from __future__ import annotations

import abc
import dataclasses
import json

from bridge.tasks.chat_turns import turn_format
from bridge.tasks.env import Environment
from bridge.tasks.sandbox import Limits, sandbox_for
from bridge.tasks.tool_calls import MalformedCall, parse_tool_calls


@dataclasses.dataclass(frozen=True)
class Tool:
    """A function the model may call: `target` ("module:function", run in the sandbox with
    the call's arguments as keywords) and its schema as chat templates take it (OpenAI's
    {"type": "function", "function": {"name", "description", "parameters"}})."""

    target: str
    schema: dict
    # False: the result may differ between calls with the same arguments (a clock, a random
    # draw, the web): the environment runs on the trusted side only (module docstring).
    deterministic: bool = True

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


class ToolEnvironment(Environment):
    """Base of tool-using environments (module docstring). Deterministic in (seed, actions)
    when its tools are."""

    tools: tuple[Tool, ...] = ()
    hidden_state = False  # the question is the prompt: the worker may play it itself

    def __init__(
        self,
        turns: str = "plain",
        cpu_s: int = 2,
        wall_s: float = 5.0,
        memory_mb: int = 256,
        thinking: str = "",
    ):
        self.turns = turn_format(turns, thinking)
        self.limits = Limits(cpu_s=int(cpu_s), wall_s=float(wall_s), memory_mb=int(memory_mb))
        self._by_name = {t.name: t for t in self.tools}
        self.results: list[str] = []  # every call's result this episode, in order
        self._drawn: list[str] | None = None  # the last step's call results
        self._given: list[str] | None = None  # results a replay takes back (redraw)

    @property
    def deterministic(self) -> bool:
        return all(t.deterministic for t in self.tools)

    @abc.abstractmethod
    def question(self, seed: int) -> str:
        """The episode's task text for `seed` (the user turn)."""

    @abc.abstractmethod
    def score(self, answer: str) -> float:
        """The reward of the model's final answer."""

    def tool_schemas(self) -> str:
        """The tools as the template's `tools=` (PromptFormat.tools: JSON text)."""
        return json.dumps([t.schema for t in self.tools])

    def reset(self, seed: int) -> str:
        self.seed, self.results, self._drawn, self._given = seed, [], None, None
        return self.question(seed)

    def drawn(self) -> list[str] | None:
        """The last step's call results when a tool may draw (else None: a replay
        recomputes them)."""
        return None if self.deterministic else self._drawn

    def redraw(self, drawn: list[str]) -> None:
        if not isinstance(drawn, list) or not all(isinstance(r, str) for r in drawn):
            raise ValueError(f"recorded tool results must be a list of strings, got {drawn!r}")
        self._given = list(drawn)

    def call(self, call) -> str:
        """One call's result text (an `error: ...` the model can read when it failed)."""
        if isinstance(call, MalformedCall):
            return f"error: malformed tool call: {call.error}"
        tool = self._by_name.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r}; tools: {', '.join(self._by_name)}"
        result = sandbox_for(self.limits).call(tool.target, call.arguments)
        return result.text if result.ok else f"error: {result.text}"

    def step(self, action: str) -> tuple[str, float, bool]:
        calls, given, self._given, self._drawn = parse_tool_calls(action), self._given, None, None
        if not calls:
            return "", float(self.score(action)), True
        if given is not None and len(given) != len(calls):
            raise ValueError(f"{len(given)} recorded results for a turn of {len(calls)} calls")
        results = list(given) if given is not None else [self.call(c) for c in calls]
        self.results += results
        self._drawn = results
        return self.turns.tool_results(results), 0.0, False
