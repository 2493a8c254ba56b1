"""Environments written for Prime Intellect's `verifiers` (v1 API) as echo2 environments.

    python -m learner_jax.train --config=configs/verifiers_tools.py --workdir=DIR \
        --config.task.verifiers_env=bridge.tasks.verifiers_envs.calculator

`task.name=verifiers`, `task.verifiers_env=<module>`: the module is a verifiers environment
package as the Environments Hub ships them, exporting through `__all__` one `vf.Taskset`
subclass and optionally one `vf.Env` subclass (a taskset alone plays `SingleAgentEnv`). Other
task options are the taskset's config fields (`task.env_options`), e.g. TextArena's `game`.

How an episode runs. echo2 plays the verifiers *harness* (the program that talks to the
model) and the *agents* an env's `run(task, agents)` drives; everything else is the env's
own code, unchanged:
- the taskset's `Task` (prompt, system prompt, `@vf.reward` / `@vf.metric` functions, its
  judges) and its `Toolset`s (`@vf.tool` methods, served by a real in-process MCP server,
  `mcp.server.mcpserver.MCPServer`, and called through it: argument validation included);
- an env with its own `run()` (TextArena's: the game engine steps host-side as the user) runs
  that coroutine, whose `agents.<role>.interaction(task)` / `.run(task)` are echo2's;
- a model call is the suspension point: the coroutine is driven by hand (`send`), so
  `reset` returns the text up to the first model call and each `step(action)` resumes it
  with the model's turn until the next call (or the end: the env's rubric scores the trace).

A harness segment is the chat loop of verifiers' null harness: the model answers; each
Qwen3 `<tool_call>` in its turn is executed and the results are the next observation; a
turn without tool calls is the segment's reply. A malformed call, an unknown tool or a tool
that raises is an observation for the model (verifiers' tool-error convention), never a
crash. Text is in the chat template's own format (bridge/tasks/chat_turns.py: the opening
messages rendered with the tools declared, then each environment turn as the text the
template writes after a model turn's end-of-turn token), so the model's tokens are never
re-rendered.

Trust: this is an echo2 `Environment`, so everything in bridge/tasks/env.py holds: the
controller hosts each leased episode (tools run on the trusted side, the worker only
samples), the reward is the trusted replay's (reset(seed), then the decoded model turns),
and a submission whose environment tokens differ from the replay's is refused. Envs must be
deterministic in (task, model turns): TextArena seeds its engine from the task.

Departures from verifiers' own runner (docs/design/verifiers.md): no harness program, no
interception server, no runtime box, so neither `uv` nor network is needed. Tools run where
the controller replays episodes: a reward-pool process (bridge/tasks/reward_pool.py), killed
at `controller.reward_timeout_s`; not in bridge/tasks/sandbox.py, whose child may read
nothing outside the Python installation (an env module in a checkout) and may open no socket
(asyncio's self-pipe, which verifiers' MCP tool path needs). Hosted parts are refused by name
when an env asks for them: a runtime-dependent reward (it needs a sandbox box), a judge (it
needs a model endpoint).

Warm start: verifiers has no demonstrations; an env module may export `demonstration(task)
-> list[str]` (a scripted player's model turns, an echo2 extension), which `demonstrations`
turns into SFT pairs (the opening text, the first turn).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import importlib
import itertools
import json
from collections.abc import Sequence
from typing import Any

from bridge.tasks.base import RewardError
from bridge.tasks.chat_turns import TemplateTurns, turn_format
from bridge.tasks.env import Environment, register_env
from bridge.tasks.tool_calls import CLOSE, OPEN, THINK_CLOSE, MalformedCall, parse_tool_calls

MAX_TOOL_CALLS = 8  # per model turn: more is refused as an observation, not executed


def run_sync(coro):
    """Run an async verifiers call to completion from sync code, also under a running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


class _ModelCall:
    """Awaited by the env's coroutine where verifiers would call the model: the driver gets
    the observation text, and resumes the coroutine with the model's turn (text)."""

    def __init__(self, observation: str):
        self.observation = observation

    def __await__(self):
        return (yield self)


def load_plugin(spec: str):
    """(Taskset class, Env class or None) exported by the module `spec` via `__all__`."""
    import verifiers.v1 as vf

    if not spec:
        raise ValueError("task verifiers needs verifiers_env=<module> (a verifiers env package)")
    module = importlib.import_module(spec)
    names = getattr(module, "__all__", None)
    if names is None:
        raise ValueError(f"verifiers env module {spec!r} has no __all__ (verifiers' convention)")
    found = {}
    for base in (vf.Taskset, vf.Env):
        hits = [
            o
            for n in names
            if isinstance(o := getattr(module, n, None), type) and issubclass(o, base)
        ]
        if len(hits) > 1:
            raise ValueError(f"{spec!r} exports {len(hits)} {base.__name__} classes; need one")
        found[base] = hits[0] if hits else None
    if found[vf.Taskset] is None:
        raise ValueError(f"verifiers env module {spec!r} exports no Taskset")
    env = found[vf.Env]
    if env is not None and env.run is vf.SingleAgentEnv.run:
        env = None
    return found[vf.Taskset], env


@functools.lru_cache(maxsize=8)
def _load(key: str):
    """(Taskset class, Env class, taskset, its tasks) for one (module, tasks, options): built
    once per process, since every trusted replay builds a fresh environment."""
    import verifiers.v1 as vf
    from verifiers.v1.utils.generic import concrete_type

    spec, limit, options = json.loads(key)
    taskset_cls, env_cls = load_plugin(spec)
    cfg_cls = concrete_type(taskset_cls, vf.TasksetConfig) or vf.TasksetConfig
    taskset = taskset_cls(cfg_cls.model_validate({"id": spec, **options}))
    it = iter(taskset)
    tasks = list(it if taskset.bounded else itertools.islice(it, limit))
    if not tasks:
        raise ValueError(f"verifiers taskset {spec!r} has no tasks")
    return taskset_cls, env_cls, taskset, tasks


@register_env("verifiers", max_turns=4, turn_max_tokens=64)
class VerifiersEnvironment(Environment):
    """One verifiers env (taskset + its Env's `run`), an episode per task; see the module doc.

    Options: `verifiers_env` (the module), `tasks` (how many of an endless taskset's tasks
    the seeds cycle through), `turns` (the model's chat format, bridge/tasks/chat_turns.py:
    "qwen3" | "llama3" | "plain"), `thinking` (the template's enable_thinking: the run's
    `task.thinking`), and the taskset config's own fields."""

    def __init__(
        self,
        verifiers_env: str = "",
        tasks: int = 64,
        turns: str = "qwen3",
        thinking: str = "",
        **taskset: Any,
    ):
        self.spec = verifiers_env
        key = json.dumps([verifiers_env, int(tasks), taskset], sort_keys=True)
        self.taskset_cls, self.env_cls, self.taskset, self.tasks = _load(key)
        self.turns = turn_format(turns, thinking)
        self._coro = None
        self._trace = None

    # --- echo2's Environment ----------------------------------------------------------

    def reset(self, seed: int) -> str:
        self._close()
        task = self.tasks[int(seed) % len(self.tasks)]
        self._episode = _Episode(self, task)
        self._coro = self._episode.play()
        return self._advance(None)[0]

    def step(self, action: str) -> tuple[str, float, bool]:
        if self._coro is None:
            raise RewardError("verifiers env: step() after the episode ended")
        obs, done = self._advance(action)
        return obs, (self._episode.score() if done else 0.0), done

    def demonstrations(self, seed: int):
        """(opening text, first model turn) from the module's `demonstration(task)`, if any."""
        script = getattr(importlib.import_module(self.spec), "demonstration", None)
        if script is None:
            return
        for i in itertools.count():
            text = self.reset(hash((seed, i)) & ((1 << 62) - 1))
            turns = script(self._episode.task)
            if turns:
                yield text, turns[0]

    def unfinished_reward(self) -> float:
        """Cut short (echo2's max_turns or token budget): the rubric scores what was played,
        as verifiers scores a trace stopped by a limit."""
        self._close()
        return self._episode.score()

    # --- the driver -------------------------------------------------------------------

    def _advance(self, action: str | None) -> tuple[str, bool]:
        try:
            request = self._coro.send(action)
        except StopIteration:
            self._coro = None
            return "", True
        if not isinstance(request, _ModelCall):
            self._close()
            raise RewardError(
                f"verifiers env {self.spec!r} awaited {type(request).__name__} outside a model "
                "call: only model turns, tools and scoring may be awaited in an episode"
            )
        return request.observation, False

    def _close(self):
        if self._coro is not None:
            with contextlib.suppress(Exception):
                self._coro.close()
            self._coro = None


class _Episode:
    """One episode's state: the verifiers trace (messages as nodes) and the tool servers."""

    def __init__(self, owner: VerifiersEnvironment, task):
        import verifiers.v1 as vf

        self.owner, self.task = owner, task
        self.trace = vf.Trace(
            task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key),
            agent=vf.AgentInfo(config=vf.AgentConfig()),
        )
        self.servers = None
        self.tools: list[dict] = []
        self.tool_server: dict[str, Any] = {}
        self.pending: list[dict] = []  # messages since the last model turn, as chat dicts
        self.started = False
        self.scored: float | None = None

    # The trace: verifiers' message graph, one branch.
    def add(self, message, sampled: bool = False):
        from verifiers.v1.graph import MessageNode

        parent = len(self.trace.nodes) - 1 if self.trace.nodes else None
        self.trace.nodes.append(MessageNode(parent=parent, message=message, sampled=sampled))

    def start_tools(self):
        """The task's and the taskset's toolsets, each on its own in-process MCP server."""
        from mcp.server.mcpserver import MCPServer

        sets = [
            *type(self.task).toolsets(self.task.config),
            *self.owner.taskset_cls.toolsets(self.owner.taskset.config),
        ]
        for toolset in sets:
            server = MCPServer(toolset.server_name or "tools")
            toolset.register(server)
            run_sync(toolset.setup())
            run_sync(toolset.setup_task(self.task))
            for t in run_sync(server.list_tools()):
                self.tool_server[t.name] = server
                self.tools.append(
                    {
                        "type": "function",
                        "function": {
                            "name": t.name,
                            "description": t.description or "",
                            "parameters": t.input_schema,
                        },
                    }
                )

    def opening(self) -> list[dict]:
        import verifiers.v1 as vf

        data = self.task.data
        out = []
        if data.system_prompt:
            out.append({"role": "system", "content": data.system_prompt})
            self.add(vf.SystemMessage(content=data.system_prompt))
        prompt = data.prompt
        if isinstance(prompt, str):
            prompt = [vf.UserMessage(content=prompt)]
        for m in prompt or []:
            self.add(m)
            out.append(_as_chat(m))
        return out

    async def model_turn(self) -> Any:
        """Suspend for the model; returns the assistant message (tool calls parsed)."""
        import verifiers.v1 as vf

        if not self.started:
            self.started = True
            text = _opening_text(self.owner.turns, self.pending, self.tools)
        else:
            text = self.owner.turns.env_text(self.pending)
        self.pending = []
        action = await _ModelCall(text)
        calls = parse_tool_calls(action)
        reasoning, content = _split_turn(action)
        ids = [f"call_{i}" for i in range(len(calls))]
        message = vf.AssistantMessage(
            content=content,
            reasoning_content=reasoning,
            tool_calls=[
                vf.ToolCall(id=i, name=c.name, arguments=json.dumps(c.arguments))
                for i, c in zip(ids, calls, strict=True)
                if not isinstance(c, MalformedCall)
            ]
            or None,
        )
        self.add(message, sampled=True)
        return message, list(zip(ids, calls, strict=True))

    def tool_results(self, calls) -> None:
        """Execute the calls (or refuse them) and queue each result as a tool message."""
        import verifiers.v1 as vf

        for i, (call_id, c) in enumerate(calls):
            if isinstance(c, MalformedCall):
                text = f"error: malformed tool call: {c.error}"
            elif i >= MAX_TOOL_CALLS:
                text = f"error: more than {MAX_TOOL_CALLS} tool calls in a turn"
            elif c.name not in self.tool_server:
                text = f"error: unknown tool {c.name!r}; tools: {', '.join(self.tool_server)}"
            else:
                text = _call_tool(self.tool_server[c.name], c.name, c.arguments)
            self.add(vf.ToolMessage(tool_call_id=call_id, content=text))
            self.pending.append({"role": "tool", "content": text})

    async def segment(self, user: str | None) -> Any:
        """One harness segment: the user's message (if any), then model turns with their
        tool calls executed until a turn without calls; returns verifiers' `Segment`."""
        import verifiers.v1 as vf

        if user is not None:
            self.add(vf.UserMessage(content=user))
            self.pending.append({"role": "user", "content": user})
        produced = []
        while True:
            message, calls = await self.model_turn()
            produced.append(message)
            if not calls:
                return vf.Segment(messages=produced)
            self.tool_results(calls)
            produced.extend(n.message for n in self.trace.nodes[-len(calls) :])

    async def play(self):
        """The episode: the env's own `run()` over echo2's agents, or the single-agent run."""
        import verifiers.v1 as vf
        from verifiers.v1.configs.env import EnvConfig
        from verifiers.v1.utils.generic import concrete_type

        self.start_tools()
        env_cls = self.owner.env_cls
        if env_cls is None:
            await _Agent(self).run(self.task)
            return
        config = (concrete_type(env_cls, EnvConfig) or EnvConfig)()
        env = env_cls.__new__(env_cls)  # run() is the env's hook; the serving machinery is ours
        env.config = config
        agents = vf.Agents(config, lambda name, spec: _Agent(self))
        await env.run(self.task, agents)

    def score(self) -> float:
        """The env's rubric on the trusted side: the task's rewards, metrics and judges over
        the trace (plus any reward the env's run() recorded), weighted as verifiers sums."""
        if self.scored is None:
            _refuse_hosted(self.task)
            run_sync(self.task.score(self.trace))
            self.scored = float(self.trace.reward)
        return self.scored


class _Agent:
    """An agent seat, played by echo2's model: the two entry points an env's run() uses."""

    def __init__(self, episode: _Episode):
        self.episode = episode

    async def run(self, task) -> Any:
        ep = self.episode
        ep.pending.extend(ep.opening())
        await ep.segment(None)
        return ep.trace

    @contextlib.asynccontextmanager
    async def interaction(self, task, **_):
        ep = self.episode
        yield _Interaction(ep)


class _Interaction:
    def __init__(self, episode: _Episode):
        self.episode = episode
        self.trace = episode.trace

    async def turn(self, message: str | None = None):
        ep = self.episode
        if not ep.trace.nodes:
            ep.pending.extend(ep.opening())
        return await ep.segment(message)


def _opening_text(turns, messages: list[dict], tools: list[dict]) -> str:
    """The episode's first text: the opening messages with the tools declared, in the chat
    template's format through the generation prompt (plain: the texts on their lines)."""
    if isinstance(turns, TemplateTurns):
        return turns.render(messages, tools=tools or None, add_generation_prompt=True)
    head = [f"Tools: {json.dumps(tools)}"] if tools else []
    return "\n".join(head + [m["content"] for m in messages]) + "\n"


def _split_turn(text: str) -> tuple[str | None, str]:
    """(reasoning, reply) of a model turn: the reply is what follows the last </think>,
    without its tool-call blocks (verifiers keeps calls in `tool_calls`, not in content)."""
    reasoning = None
    if THINK_CLOSE in text:
        thought, text = text.rsplit(THINK_CLOSE, 1)
        reasoning = thought.replace("<think>", "").strip()
    while OPEN in text:
        head, _, rest = text.partition(OPEN)
        text = head + (rest.split(CLOSE, 1)[1] if CLOSE in rest else "")
    return reasoning, text.strip()


def _as_chat(message) -> dict:
    from verifiers.v1.types import content_text

    return {"role": message.role, "content": content_text(message.content)}


def _call_tool(server, name: str, arguments: dict) -> str:
    """A tool's result as text; a tool error (bad arguments, a raise) as an error text."""
    try:
        result = run_sync(server.call_tool(name, arguments))
    except Exception as e:  # noqa: BLE001 - any tool failure is an observation, not a crash
        return f"error: {type(e).__name__}: {e}"
    texts = [getattr(c, "text", "") for c in result.content]
    text = "\n".join(t for t in texts if t)
    return f"error: {text}" if result.is_error else text


def _refuse_hosted(task) -> None:
    """Name what needs a hosted service instead of scoring without it."""
    import inspect

    if task.config.judges:
        raise RewardError(
            "verifiers judges need a model endpoint (a hosted judge): not available to the "
            f"trusted side here; task {type(task).__name__} plugs {len(task.config.judges)}"
        )
    for fn in (*task.hooks("reward"), *task.hooks("metric")):
        p = inspect.signature(fn).parameters.get("runtime")
        if p is not None and p.default is inspect.Parameter.empty:
            raise RewardError(
                f"verifiers reward {fn.__name__!r} needs a runtime box (a sandbox service: "
                "docker, prime, modal, e2b): not available to the trusted side here"
            )


def transcript(env: VerifiersEnvironment, seed: int, actions: Sequence[str]) -> list[dict]:
    """The replayed episode's verifiers messages (for docs and tests)."""
    env.reset(seed)
    for a in actions:
        _, _, done = env.step(a)
        if done:
            break
    return [n.message.model_dump(exclude_none=True) for n in env._episode.trace.nodes]
