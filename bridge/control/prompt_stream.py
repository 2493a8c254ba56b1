"""The task's endless training prompts as the controller draws them, resumable.

The database counts the prompts drawn so far (`prompts_drawn`); a stream opened on an old
database skips that many, so a restarted controller never hands out a prompt twice, and
`skip_to` catches up with a checkpoint that drew more than the database remembers.
"""

from __future__ import annotations

import itertools

from bridge.control.db import ControllerDB
from bridge.tasks import Prompt, Task


class PromptStream:
    """`task.train_prompts(seed)`, positioned at the database's `prompts_drawn`."""

    def __init__(self, task: Task, seed: int, db: ControllerDB):
        self.db = db
        # Draw one prompt now so a broken task (say, a missing data file) fails here, at
        # startup, not inside a worker's request; then resume where the last run stopped.
        prompts = task.train_prompts(seed)
        self._prompts = itertools.chain([next(prompts)], prompts)
        self._skip(db.get("prompts_drawn", 0))

    def _skip(self, n: int) -> None:
        for _ in itertools.islice(self._prompts, n):
            pass

    def draw(self, k: int) -> list[Prompt]:
        """The next `k` prompts, counted as drawn (in the caller's transaction)."""
        new = list(itertools.islice(self._prompts, k))
        self.db.incr("prompts_drawn", len(new))
        return new

    def skip_to(self, drawn: int) -> None:
        """Skip ahead until `drawn` prompts are drawn; never back (those may be queued)."""
        have = self.db.get("prompts_drawn", 0)
        if drawn > have:
            self._skip(drawn - have)
            self.db.put("prompts_drawn", drawn)
