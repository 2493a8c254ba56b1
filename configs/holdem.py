"""Heads-up limit hold'em through pokerkit against a scripted opponent
(bridge/tasks/holdem.py): multi-turn episodes of one hand each. Launch:

    python -m learner_jax.train --config=configs/holdem.py --workdir=/tmp/echo2_holdem

Meant for real models (`--config.model.hf_dir=...`, `--config.task.turn_max_tokens=4`
for word actions like "call"); with the tiny character-level model it is the multi-turn
plumbing's end-to-end check (tests/learner_jax/train_holdem_test.py). Rewards are chips
won or lost in the hand (blinds 1/2, bets 2/4). Everything else is configs/kuhn_poker.py.
"""

from learner_jax.config_file import base_config


def get_config():
    c = base_config(__file__, "kuhn_poker")
    c.task.name = "holdem"
    c.task.max_turns = 8  # model decisions per hand at most (then the hand is folded)
    c.task.turn_max_tokens = 1  # "f" / "c" / "r"
    c.task.invalid = "fold"  # what an unparseable action does ("call" keeps a hand going)
    c.task.bluff = 0.1  # the scripted opponent's bluff-raise probability
    c.batch.max_prompt_len = 40  # BOS + "Holdem AsKd bb. opp r. you:"
    c.batch.max_answer_len = 256  # every turn and observation of the hand
    c.batch.micro_batch_size = 64
    return c
