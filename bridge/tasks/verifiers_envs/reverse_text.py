"""Single turn, in verifiers' v1 API: reverse a short word.

One prompt, one reply, no tools. The reward (`@vf.reward reversed_chars`) is the fraction of
positions where the reply's first word matches the reversed word (partial credit, so a small
model's reward is not all zeros).
"""

from __future__ import annotations

import random
import string

import verifiers.v1 as vf


class ReverseData(vf.TaskData):
    word: str


class ReverseTask(vf.Task[ReverseData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def reversed_chars(self, task: ReverseData, trace: vf.Trace) -> float:
        target = task.word[::-1]
        words = trace.last_reply.split()
        reply = words[0] if words else ""
        hits = sum(a == b for a, b in zip(reply, target, strict=False))
        return hits / max(len(target), len(reply))


class ReverseConfig(vf.TasksetConfig):
    size: int = 64
    seed: int = 0
    length: int = 4


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self):
        rng = random.Random(self.config.seed)
        for i in range(self.config.size):
            word = "".join(rng.choice(string.ascii_lowercase) for _ in range(self.config.length))
            yield ReverseTask(
                ReverseData(name=f"reverse#{i}", prompt=f"Reverse: {word}", word=word),
                self.config.task,
            )


__all__ = ["ReverseTaskset"]
