"""spell_backward with a sloppy teacher (issue 27): RL, not SFT, does the +25 points.

    python -m learner_jax.train --config=configs/reasoning_gym_spell_backward_sloppy.py \
        --workdir=/tmp/echo2_spell_sloppy [--config.seed=1]

configs/reasoning_gym_spell_backward.py clears +25 points of held-out accuracy mostly by
SFT: with right answers to imitate, SFT beats GRPO per step on this task. Here the SFT
teacher swaps the first two letters of 70% of its answers (task.sft_label_noise, the
demo's sloppy-teacher design in configs/tiny_arith.py): the warm-started policy reverses
the word and then swaps, so its greedy answer is wrong while its samples are right about a
third of the time, and RL against the exact verifier has to unlearn the habit. The
held-out words, the prompts and the reward are the exact task's.
"""

from learner_jax.config_file import base_config


def get_config():
    c = base_config(__file__, "reasoning_gym_spell_backward")
    c.task.sft_label_noise = 0.7
    c.sft.steps = 300  # past SFT's jump: the policy knows the reversal (and the habit)
    return c
