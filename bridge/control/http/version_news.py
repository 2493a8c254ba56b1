"""Held heartbeats: a worker generating a partial-rollout lease hears of a new version when
it is published, not at its next heartbeat (issue 48).

With `rollout.partial=continue` a worker swaps in a newer version mid-lease and continues
its unfinished samples under it (rollout_gpu/generate.py `continue_groups`). It can swap
only once it has heard of the version, and heartbeats are seconds apart (further as the
fleet grows, heartbeat_pacing.py): on the CPU demo, where a learner step takes ~0.3-1 s,
a lease heard of versions 3-15 steps late. A heartbeat that carries `news_after` (the
`published_at` of the newest announcement its worker has heard) is therefore held until
the controller announces a version published after it, or for one heartbeat interval
(at most `MAX_HOLD_S`), whichever comes first; the answer is an ordinary heartbeat's,
computed when it is sent, so a worker that sends the next held heartbeat at once keeps its
liveness cadence. A held heartbeat costs an idle connection and a pending future on the
event loop, no thread and no polling: the controller's publish (on the learner's thread)
wakes the loop (`Controller.on_publish`).
"""

from __future__ import annotations

import asyncio

# Below the worker client's 60 s request timeout (http/client.py), with room for the reply.
MAX_HOLD_S = 30.0


class VersionNews:
    """Held heartbeats of one controller, answered on the event loop that awaits `hold`."""

    def __init__(self, controller):
        self._announced_at = controller.announced_at
        self._waiting: set[asyncio.Future] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._released = False
        controller.on_publish(self._published)

    def release(self) -> None:
        """The server is stopping: answer every held heartbeat now and hold no more (a
        stopping training binary waits for its requests in flight)."""
        self._released = True
        self._published()

    def _published(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        for waiter in self._waiting:
            if not waiter.done():
                waiter.set_result(None)
        self._waiting.clear()

    async def hold(self, after: float, hold_s: float) -> None:
        """Return once a version published after `after` is announced, or after `hold_s`
        (at most `MAX_HOLD_S`)."""
        loop = self._loop = asyncio.get_running_loop()
        deadline = loop.time() + min(max(hold_s, 0.0), MAX_HOLD_S)
        # A publish between this check and the await below still wakes the future: the
        # publisher's wake-up runs on this loop, after this coroutine yields.
        while self._announced_at() <= after and not self._released:
            left = deadline - loop.time()
            if left <= 0:
                return
            waiter = loop.create_future()
            self._waiting.add(waiter)
            try:
                await asyncio.wait_for(waiter, left)
            except TimeoutError:
                return
            finally:
                self._waiting.discard(waiter)
