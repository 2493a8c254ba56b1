"""Kuhn poker against a fixed opponent (bridge/tasks/kuhn_poker.py): multi-turn RL whose
optimum is known exactly. Launch:

    python -m learner_jax.train --config=configs/kuhn_poker.py --workdir=/tmp/echo2_kuhn
    python -m bench.kuhn_curve --workdir=/tmp/echo2_kuhn     # table + kuhn_poker.png

The model plays one hand per episode, in either seat, one token per decision ("c"
check/call, "b" bet, "f" fold; anything else folds): the controller replays every
episode from its seed and the decoded actions, the learner trains on the model's tokens
only (the opponent's moves between them are masked). The policy's expected chips per hand
are computed exactly at every evaluation (all 12 deal x seat situations and the
opponent's mixed moves, from the policy's action probabilities: `eval/expected_reward`)
against the best response's +0.25 (`eval/optimum_reward`); `python -m bench.kuhn_curve
--workdir=W` also prints each decision's action probabilities against the best response.

Recipe (BUILD_NOTES.md, "Kuhn poker: why it stalled, and Dr. GRPO" and "Kuhn poker at the
optimum: a KL anchor to the warm start"): a format-only SFT whose teacher answers from a
random mixed strategy per information set (a teacher that answers the same everywhere made
the policy blind to its card), then Dr. GRPO advantages (GRPO's per-group std
normalization is biased when a group shares the hidden card) at lr 1e-3 with a 20-step
warmup, and a KL penalty to the SFT policy (beta 0.05, cosine to 0 over the 500 RL steps).
Without the anchor the rare best action at a rare state stops being explored (J's bluff
after a check, at +0.189) and 1e-3 collapses onto illegal tokens; with it the policy keeps
every action alive early and commits as beta decays.
Measured (2-core box, three seeds at once beside a CI run, load 11-21): -0.385 / -0.322 /
-0.353 after SFT, +0.2435 / +0.2431 / +0.2431 after 500 RL steps for seeds 0 / 1 / 2
(optimum +0.25, 5% = +0.2375, first reached after 330 / 360 / 360 RL steps).

`task.illegal_penalty` (default 0 here) fines a hand whose decision text is no action (the
format penalty; the exact evaluation still scores the game, junk = fold). With 1.0 the
1e-3 collapse onto illegal tokens is gone (legal mass >= 0.90 for 300 steps), but the
plateau is lower (+0.120 at 1e-3, +0.108 at 5e-4 after 300 steps, seed 0): the bluff
survives and the fold dies instead (BUILD_NOTES.md, "Kuhn poker reaches the optimum").

Everything else is configs/tiny_arith.py, with a smaller model and one local worker.
"""

from learner_jax.config_file import base_config


def get_config():
    c = base_config(__file__, "tiny_arith")
    c.total_steps = 500  # RL steps after the SFT warm start
    c.local_workers = 1
    c.model.tiny_num_layers, c.model.tiny_hidden_size, c.model.tiny_intermediate_size = 2, 64, 128

    c.task = c.task.__class__()  # the arithmetic task's keys do not apply
    c.task.name = "kuhn_poker"
    c.task.max_turns = 2  # the model decides at most twice per hand
    c.task.turn_max_tokens = 1  # one token per decision (exact evaluation needs it)
    c.task.eval_size = 64
    c.task.reward_fn = ""
    c.task.module = ""  # a module to import first: your own environment (README)
    c.task.illegal_penalty = 0.0  # chips off the training reward per junk decision (above)

    c.batch.groups_per_step = 16  # hands (each dealt n times: a GRPO group)
    c.batch.samples_per_group = 16
    c.batch.micro_batch_size = 256
    c.batch.max_prompt_len = 24  # BOS + "Kuhn J. opp b. you J:"
    c.batch.max_answer_len = 16  # action + " opp b. you J:" + action

    # Format-only warm start: each first decision answered by a random action letter from a
    # random per-information-set strategy (KuhnPoker.demonstrations): legal actions and a
    # policy that reads its card, with no strategy.
    c.sft.steps = 100
    c.sft.batch_size = 64
    c.sft.micro_batch_size = 64
    # Dr. GRPO: rewards minus the group mean, no std division (see the docstring).
    c.advantages.name = "dr_grpo"
    # The RL phase starts Adam cold: rates >= 5e-4 need warmup_steps >= 10 (the binary
    # warns). 1e-3 without the KL anchor climbed fastest and then collapsed
    # (docs/results.md, Kuhn poker).
    c.optimizer.learning_rate = 1e-3
    c.optimizer.warmup_steps = 20
    # KL to the SFT policy (learner_jax/training/reference_policy.py): strong early, 0 at the end.
    c.loss.kl_coef = 0.05
    c.loss.kl_end_fraction = 0.0
    c.rollout.eval_period = 5
    c.checkpoint.interval = 40
    return c
