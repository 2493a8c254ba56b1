"""Ctrl-C during RL: finish the current step, checkpoint, shut down in order.

    with StopOnCtrlC(notify) as stop:
        for item in BatchSource(..., should_stop=stop.requested): ...

The first SIGINT only sets a flag (the batch stream ends, the binary checkpoints, stops
its workers and writes the report); a second one raises KeyboardInterrupt at once. The
previous handler is restored on exit. Workers run in their own process group, so the
terminal's Ctrl-C reaches the learner alone and it decides the order.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

MESSAGE = "Ctrl-C: finishing this step, then checkpointing (Ctrl-C again to abort)"


class StopOnCtrlC:
    def __init__(self, notify: Callable[[str], None] = print):
        self.notify = notify
        self._requested = False
        self._prev = None

    def requested(self) -> bool:
        return self._requested

    def _handle(self, *_):
        if self._requested:
            raise KeyboardInterrupt
        self._requested = True
        self.notify(MESSAGE)

    def __enter__(self):
        self._prev = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._prev)
