"""Environments written against `verifiers`' v1 API, as an Environments Hub package is
written (a module exporting its Taskset, and its Env if it has one, through `__all__`), for
echo2's adapter (bridge/tasks/verifiers_env.py) to run offline:

- `calculator`: multi-turn tool use (a `Toolset` with a `calculate` tool, a `@vf.reward`).
- `reverse_text`: single turn (no tools, one reply, a partial-credit reward).
- `textarena_local`: verifiers' own `TextArenaEnv` (the game engine plays the user) over a
  taskset built from the local TextArena engine, for games that need no downloaded data.

Importing these needs the `envs` extra (verifiers, textarena); nothing imports them but the
adapter, when a config names one.
"""
