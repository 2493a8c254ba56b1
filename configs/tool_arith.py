"""Arithmetic with a calculator tool (bridge/tasks/tool_arith.py): multi-turn tool use that
RL improves on a CPU. Launch:

    python -m learner_jax.train --config=configs/tool_arith.py --workdir=/tmp/echo2_tool

An episode is "37*48=" -> the model's tool call `<tool_call>{"name": "calc", "arguments":
{"expr": "37*48"}}</tool_call>` -> the calculator's result, run in the sandbox
(bridge/tasks/sandbox.py), appended as `<tool_response>` tokens -> the model's answer,
rewarded 1 when it is the product. The worker plays the episode (the lease carries the
seed: a question hides nothing) and the controller replays it from the model's turns,
recomputing every tool result; a trajectory whose tool results differ is refused. The
learner trains on the model's tokens only (tool results are masked).

The SFT teacher uses the tool sloppily: a correct call 40% of the time, a malformed one
20% (then a guess), a guess without the tool otherwise. Held-out accuracy (sampled at
temperature 1, 2 episodes per problem, each played: learner_jax/evaluation/episode_eval.py)
before RL is the SFT policy's;
RL against the exact reward makes the call a habit. Measured (2-core box shared with other
jobs, 30-50 min per run): held-out accuracy 0.120 -> 0.590 / 0.010 -> 0.090 /
0.085 -> 0.635 for seeds 0 / 1 / 2, model turns per episode ~1.3 -> ~1.85 in each (the
weak seed's SFT policy copies operands and results too rarely for GRPO to get signal;
docs/design/agentic.md).

Everything else is configs/tiny_arith.py, with one local worker.
"""

from learner_jax.config_file import base_config


def get_config():
    c = base_config(__file__, "tiny_arith")
    c.total_steps = 60  # RL steps after the SFT warm start
    c.local_workers = 1

    c.task = c.task.__class__()  # the arithmetic task's keys do not apply
    c.task.name = "tool_arith"
    c.task.max_turns = 3  # call, (another call), answer
    c.task.turn_max_tokens = 72  # the compact call is 67 characters, + EOS
    c.task.eval_size = 100
    c.task.tool_rate = 0.4  # the sloppy teacher (bridge/tasks/tool_arith.py)
    c.task.broken_rate = 0.2
    c.task.reward_fn = ""
    c.task.module = ""

    c.batch.groups_per_step = 8
    c.batch.samples_per_group = 8
    c.batch.micro_batch_size = 64
    c.batch.max_prompt_len = 8  # BOS + "37*48="
    c.batch.max_answer_len = 120  # call + EOS + tool response + answer (~112)

    # 2 x 128 (the demo's 4 layers cost twice the time; copying operands needs no depth).
    c.model.tiny_num_layers = 2
    c.sft.steps = 300
    c.sft.batch_size = 32
    c.sft.micro_batch_size = 32
    c.sft.learning_rate = 2e-3
    c.optimizer.learning_rate = 3e-4
    c.optimizer.warmup_steps = 10
    c.rollout.eval_period = 20
    # Sampled at the rollouts' temperature, 2 per problem: the habit (call the tool or
    # guess) is the policy's distribution, which greedy decoding would hide.
    c.eval.temperature = 1.0
    c.eval.n = 2
    # The first tool call in each reward-pool process starts the sandbox's helper process
    # (a fresh interpreter): seconds on a loaded machine, past the 5 s default.
    c.controller.reward_timeout_s = 30.0
    c.checkpoint.interval = 20
    return c
