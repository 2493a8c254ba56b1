"""A real-shaped run on a CPU: Qwen3 architecture and Qwen3's tokenizer format and chat
template, random weights at small width, answers of 576 tokens sampled at temperature 0.7,
through the whole system (controller, a local vLLM worker, packing, the RL step) for a few
steps. What it shows is numerics, not learning: `mismatch/kl` (worker vs learner log-probs
of the same version) stays at float noise at T < 1 with long chat-formatted sequences,
while a dense toy reward (configs/rewards/digit_share.py) makes every step change weights.

    python -m learner_jax.train --config=configs/qwen3_shaped.py --workdir=/tmp/echo2_qwen3
"""

from learner_jax.config_file import base_config


def get_config():
    c = base_config(__file__, "tiny_arith")
    c.total_steps = 3
    c.staleness = 0  # every batch sampled by the learner's current version: all on-policy
    c.local_workers = 1
    c.fleet.prices, c.fleet.throttle_s = (0.40,), (0.0,)
    c.model.tiny_tokenizer = "qwen3"
    c.model.tiny_never_stop = True  # random answers run to max_answer_len
    c.model.tiny_num_layers, c.model.tiny_hidden_size, c.model.tiny_intermediate_size = 2, 64, 128
    c.model.dtype = "float32"  # the engine is fp32 too: mismatch/kl is then float noise
    c.prompt.format = "chat"
    c.prompt.system = "You are a careful calculator."
    c.prompt.thinking = "off"
    c.rollout.temperature = 0.7
    c.rollout.eval_period = 0  # held-out accuracy at the start and the end only
    # Rewards that differ between samples, so each step changes the weights (the task's own
    # exact-answer reward is 0 for every random answer).
    c.task.reward_fn = "configs/rewards/digit_share.py:compute_score"
    c.task.eval_size = 1  # greedy 576-token decodes are slow on a shared CPU
    c.sft.steps = 0
    c.batch.groups_per_step = 2
    c.batch.samples_per_group = 4
    c.batch.micro_batch_size = 4
    c.batch.max_prompt_len = 96  # the chat-formatted prompt is ~70 byte-level tokens
    c.batch.max_answer_len = 576
    c.batch.packing = True
    c.checkpoint.interval = 100
    return c
