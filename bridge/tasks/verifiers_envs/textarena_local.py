"""verifiers' TextArena env over a taskset built from the local TextArena engine.

The env is verifiers' own `TextArenaEnv` (verifiers/v1/tasksets/textarena): its `run()` seeds
the engine from the task, takes the model's move, steps the game host-side and answers with
the next observation until the game is over, then records `game_reward`. verifiers' own
taskset offers Wordle, Hangman, WordLadder and WordSearch, which all need NLTK's `words`
corpus (and Wordle its POS tagger) downloaded from GitHub at load: no network here. This
taskset builds the same tasks (prompt = the seeded first observation, `info` = game and
seed) for the single-player games whose engine needs no downloaded data.
"""

from __future__ import annotations

import copy
import itertools
import random
from typing import Literal

import textarena as ta
import verifiers.v1 as vf
from verifiers.v1.tasksets.textarena.taskset import (
    SYSTEM_PROMPT,
    TextArenaData,
    TextArenaEnv,
    TextArenaTask,
)


class LocalTextArenaConfig(vf.TasksetConfig):
    game: Literal["GuessTheNumber-v0", "Mastermind-v0", "FrozenLake-v0"] = "GuessTheNumber-v0"


class LocalTextArenaTaskset(vf.Taskset[TextArenaTask, LocalTextArenaConfig]):
    INFINITE = True

    def load(self):
        template = ta.make(env_id=self.config.game)

        def observation(seed: int) -> str:
            random.seed(seed)
            env = copy.deepcopy(template)
            env.reset(num_players=1)
            return str(env.get_observation()[1])

        first = observation(0)
        seed_specific = observation(1) != first
        for i in itertools.count():
            yield TextArenaTask(
                TextArenaData(
                    name=f"{self.config.game}#{i}",
                    prompt=observation(i) if seed_specific else first,
                    system_prompt=SYSTEM_PROMPT,
                    info={"game": self.config.game, "seed": i},
                ),
                self.config.task,
            )


__all__ = ["LocalTextArenaTaskset", "TextArenaEnv"]
