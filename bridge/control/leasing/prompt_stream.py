"""The task's endless training prompts as the controller draws them, resumable.

The database counts the prompts drawn so far (`prompts_drawn`); a stream opened on an old
database skips that many, so a restarted controller never hands out a prompt twice, and
`skip_to` catches up with a checkpoint that drew more than the database remembers.

A task whose prompts hide state from workers (`Task.hides_state`: an episode's seed is its
deal) is drawn from `stream_seed(secret, seed)` = HMAC-SHA256(run secret, seed), a 256-bit
int, not from the config's public `seed`: otherwise a worker rebuilds the stream, finds its
prompt in it (by prompt id, or by its group id's position) and reads the hidden state. The
secret is made on first use and kept in the controller database's kv table (as the sampling
seeds' is, sampling_seeds.py), so a restarted controller continues the same stream.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import secrets

from bridge.control.state.db import ControllerDB
from bridge.tasks import Prompt, Task

_KEY = "prompt_secret"


def _secret(db: ControllerDB) -> bytes:
    hexed = db.get(_KEY)
    if hexed is None:
        hexed = secrets.token_hex(32)
        with db.tx():
            db.put(_KEY, hexed)
    return bytes.fromhex(hexed)


def stream_seed(secret: bytes, seed: int) -> int:
    """The training stream's seed of a task that hides state: unpredictable without `secret`."""
    mac = hmac.new(secret, f"train prompts/{int(seed)}".encode(), hashlib.sha256)
    return int.from_bytes(mac.digest(), "big")


class PromptStream:
    """`task.train_prompts(seed)`, positioned at the database's `prompts_drawn`."""

    def __init__(self, task: Task, seed: int, db: ControllerDB):
        self.db = db
        # Draw one prompt now so a broken task (say, a missing data file) fails here, at
        # startup, not inside a worker's request; then resume where the last run stopped.
        if task.hides_state:
            seed = stream_seed(_secret(db), seed)
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
