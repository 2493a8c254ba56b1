"""A verifiers (v1 API) environment through the whole system: the controller hosts each
episode (tools run on the trusted side), a local vLLM worker samples the model's turns, the
env's rubric scores the trusted replay (bridge/tasks/verifiers_env.py). Random tiny Qwen3-
format model: what this shows is that episodes run and score, not learning.

    python -m learner_jax.train --config=configs/verifiers_tools.py --workdir=/tmp/echo2_vf

Other environments (docs/design/verifiers.md), same config:

    --config.task.verifiers_env=bridge.tasks.verifiers_envs.textarena_local --config.sft.steps=0
    --config.task.verifiers_env=bridge.tasks.verifiers_envs.reverse_text --config.sft.steps=0
"""

from learner_jax.config_file import base_config


def get_config():
    c = base_config(__file__, "tiny_arith")
    c.total_steps = 2
    c.local_workers = 1
    c.model.tiny_tokenizer = "qwen3"  # Qwen3's chat template: tools, <tool_call>, <|im_end|>
    c.model.tiny_num_layers, c.model.tiny_hidden_size, c.model.tiny_intermediate_size = 2, 64, 128
    c.task = c.task.__class__()  # the arithmetic task's keys do not apply
    c.task.name = "verifiers"
    c.task.verifiers_env = "bridge.tasks.verifiers_envs.calculator"
    c.task.max_turns = 3  # model turns per episode (tool calls, then the answer)
    c.task.turn_max_tokens = 96  # the scripted tool call is about 75 tokens, + its end
    c.task.eval_size = 2
    c.task.reward_fn = ""
    c.task.module = ""
    # A reward-pool process imports verifiers (and builds the taskset) on its first replay:
    # ~4 s of CPU, far more wall time on a busy 2-core box; the default 5 s limit would kill
    # every cold pool process before it is warm. Warm replays take milliseconds.
    c.controller.reward_timeout_s = 60.0
    c.rollout.eval_period = 0  # held-out episodes at the start and the end only
    # A format-only warm start from the calculator module's scripted player (its first turn,
    # a tool call), so the RL episodes call the tool. Envs without a `demonstration` set
    # --config.sft.steps=0.
    c.sft.steps = 80
    c.sft.batch_size = 8
    c.sft.micro_batch_size = 8
    c.sft.learning_rate = 3e-3
    c.sft.warmup_steps = 5
    c.batch.groups_per_step = 2
    c.batch.samples_per_group = 4
    c.batch.micro_batch_size = 4
    c.batch.max_prompt_len = 960  # the calculator's prompt with its tool schema: ~910 bytes
    c.batch.max_answer_len = 320  # 3 turns of 48 + the observations between them
    c.batch.packing = True
    c.checkpoint.interval = 100
    return c
