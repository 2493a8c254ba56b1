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
against the best response's +0.25 (`eval/optimum_reward`). Measured (one run, ~9.5 min on a
2-core CPU): the untrained policy says no legal action and folds every hand (-0.97); a
short SFT on random legal action letters (format, no strategy) gives -0.34; 300 GRPO steps
reach +0.12 (bench/kuhn_curve.py prints the curve; BUILD_NOTES.md has the other runs).

Everything else is configs/tiny_arith.py, with a smaller model and one local worker.
"""

from learner_jax.config_file import base_config


def get_config():
    c = base_config(__file__, "tiny_arith")
    c.total_steps = 300  # RL steps after the SFT warm start (~8 min on a 2-core CPU)
    c.local_workers = 1
    c.model.tiny_num_layers, c.model.tiny_hidden_size, c.model.tiny_intermediate_size = 2, 64, 128

    c.task = c.task.__class__()  # the arithmetic task's keys do not apply
    c.task.name = "kuhn_poker"
    c.task.max_turns = 2  # the model decides at most twice per hand
    c.task.turn_max_tokens = 1  # one token per decision (exact evaluation needs it)
    c.task.eval_size = 64
    c.task.reward_fn = ""
    c.task.module = ""  # a module to import first: your own environment (README)

    c.batch.groups_per_step = 16  # hands (each dealt n times: a GRPO group)
    c.batch.samples_per_group = 16
    c.batch.micro_batch_size = 256
    c.batch.max_prompt_len = 24  # BOS + "Kuhn J. opp b. you:"
    c.batch.max_answer_len = 16  # action + " opp b. you:" + action

    # Format-only warm start: each first decision answered by a uniformly random action
    # letter (KuhnPoker.demonstrations), so the policy says legal actions, with no strategy.
    c.sft.steps = 100
    c.sft.batch_size = 64
    c.sft.micro_batch_size = 64
    # 3e-4 climbs steadily. Faster rates need optimizer.warmup_steps >= 10: the RL phase
    # starts Adam cold, and at 1e-3 its first (sign) steps flattened the policy onto illegal
    # tokens for good (the binary warns). 5e-4 climbed to +0.13, then fell back mid-run
    # (BUILD_NOTES.md, issue 27: cause 2, open).
    c.optimizer.learning_rate = 3e-4
    c.optimizer.warmup_steps = 0
    c.rollout.eval_period = 5
    c.checkpoint.interval = 40
    return c
