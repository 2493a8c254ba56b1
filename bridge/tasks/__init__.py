"""Task adapters (the data plane): prompts, a reward function, optional SFT examples.

    from bridge import tasks
    task = tasks.make_task("arithmetic", digits=2, ops="+-")
    r = tasks.score(task, prompt, "46")   # float; RewardError (never a crash) on a bad reward fn

`base.py` defines what a task is, `registry.py` builds one by name; each task is a plugin
module that registers itself (`arithmetic.py` synthetic and the demo's default, `gsm8k.py`
a local JSONL, `reasoning_gym.py` reasoning-gym's procedural datasets; no downloads). Multi-turn
environments (`env.py`: reset/step, replayed on the trusted side) register a task of their
name: `kuhn_poker.py` (exact optimum known), `holdem.py` (heads-up limit hold'em, pokerkit).
Importing the package registers the built-in plugins; their heavy libraries (reasoning-gym,
math-verify: the optional `tasks` extra) load on first use.

Rewards: `math_reward.py` (math-verify equivalence), `user_reward.py` (any task's reward
replaced by options: `reward_fn="PATH.py:NAME"` in verl's convention, `reward="math_verify"`),
`reward_pool.py` (a killable process pool: each reward call under a timeout).
"""

from bridge.tasks import (  # noqa: F401  (registers the plugins)
    arithmetic,
    eval_file,
    gsm8k,
    holdem,
    kuhn_poker,
    reasoning_gym,
    tool_arith,
    tool_draw,
    verifiers_env,
)
from bridge.tasks.arithmetic import Arithmetic, leading_int
from bridge.tasks.base import Prompt, RewardError, Task, score, score_detailed
from bridge.tasks.env import Environment, EnvTask, make_env, register_env, replay
from bridge.tasks.registry import (
    available_tasks,
    cached_task,
    make_task,
    register_task,
    score_named,
)
from bridge.tasks.reward_pool import RewardPool, RewardTimeout, default_pool

__all__ = [
    "Arithmetic",
    "EnvTask",
    "Environment",
    "Prompt",
    "RewardError",
    "RewardPool",
    "RewardTimeout",
    "Task",
    "available_tasks",
    "cached_task",
    "default_pool",
    "leading_int",
    "make_env",
    "make_task",
    "register_env",
    "register_task",
    "replay",
    "score",
    "score_detailed",
    "score_named",
]
