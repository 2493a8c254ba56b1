"""Task adapters (the data plane): prompts, a reward function, optional SFT examples.

    from bridge import tasks
    task = tasks.make_task("arithmetic", digits=2, ops="+-")
    r = tasks.score(task, prompt, "46")   # float; RewardError (never a crash) on a bad reward fn

`base.py` defines what a task is, `registry.py` builds one by name; each task is a plugin
module that registers itself (`arithmetic.py` synthetic and the demo's default, `gsm8k.py`
a local JSONL, no downloads). Importing the package registers the built-in plugins.
"""

from bridge.tasks import arithmetic, gsm8k  # noqa: F401  (registers the built-in tasks)
from bridge.tasks.arithmetic import Arithmetic, leading_int
from bridge.tasks.base import Prompt, RewardError, Task, score
from bridge.tasks.registry import available_tasks, cached_task, make_task, register_task

__all__ = [
    "Arithmetic",
    "Prompt",
    "RewardError",
    "Task",
    "available_tasks",
    "cached_task",
    "leading_int",
    "make_task",
    "register_task",
    "score",
]
