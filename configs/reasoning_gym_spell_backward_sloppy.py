"""spell_backward with a sloppy teacher (issue 27): RL, not SFT, does the +25 points.

    python -m learner_jax.train --config=configs/reasoning_gym_spell_backward_sloppy.py \
        --workdir=/tmp/echo2_spell_sloppy [--config.seed=1]

configs/reasoning_gym_spell_backward.py clears +25 points of held-out accuracy mostly by
SFT: with right answers to imitate, SFT beats GRPO per step on this task. Here the SFT
teacher swaps the first two letters of 70% of its answers (task.sft_label_noise, the
demo's sloppy-teacher design in configs/tiny_arith.py): the warm-started policy reverses
the word and then swaps, so its greedy answer is wrong while its samples are right over a
quarter of the time (0.28 at the first RL step, seed 0), and RL against the exact verifier
has to unlearn the habit. The held-out words, the prompts and the reward are the exact
task's. Same model, worker, batch and RL recipe as the clean config (150 GRPO steps at lr
1e-4, 8 prompts x 8 samples); SFT runs 300 steps instead of 160.

Measured (2026-12-05, each run alone on a 2-core box, BUILD_NOTES.md "reasoning-gym: RL
does the +25 with a sloppy teacher"), held-out greedy accuracy on 200 unseen words, after
SFT -> after RL (untrained: 0.0), whole run wall time:
  seed 0: 0.115 -> 0.905 (RL +79 points; +25 after 20 RL steps, 150 s in), 4.0 min
  seed 1: 0.225 -> 0.965 (RL +74; +25 after 20 RL steps, 154 s in),         4.0 min
  seed 2: 0.125 -> 0.975 (RL +85; +25 after 20 RL steps, 155 s in),         4.1 min
Control: 450 SFT steps and no RL (seed 0) end at 0.13 (0.115 at 300): imitation keeps the habit.
"""

from learner_jax.config_file import base_config


def get_config():
    c = base_config(__file__, "reasoning_gym_spell_backward")
    c.task.sft_label_noise = 0.7
    c.sft.steps = 300  # past SFT's jump: the policy knows the reversal (and the habit)
    return c
