"""RL end to end on a CPU with a tiny Qwen3-MoE through the whole system: the controller, a
local vLLM worker computing in bf16 (the learner in fp32), delta versions, and routing
replay on (`model.moe.routing_replay=rollout`): the worker records the experts its engine
routed every token to, the submission carries them, the intake checks them, and the
learner's forward routes each token to those experts with its own gate weights (R3).

What it shows is numerics and plumbing, not learning: each step reports the learner's
per-layer agreement with the engine's routing (`moe/routing_agreement/layer_*`) and the
train/inference mismatch with and without replay on the same tokens
(`mismatch/kl_replay`, `mismatch/kl_no_replay`), from which bench/moe_routing.py takes
`replay_kl_ratio`; a dense toy reward (configs/rewards/digit_share.py) makes every step
change the weights, so each version after the first is a delta.

    python -m learner_jax.train --config=configs/qwen3_moe_shaped.py --workdir=/tmp/echo2_moe
"""

from learner_jax.config_file import base_config


def get_config():
    c = base_config(__file__, "tiny_arith")
    c.total_steps = 6
    c.staleness = 0  # every batch sampled by the learner's current version: all on-policy
    c.local_workers = 1
    c.fleet.prices, c.fleet.throttle_s = (0.40,), (0.0,)
    c.fleet.engine_dtype = "bfloat16"  # the learner stays fp32: replay's case
    c.model.tiny_family = "qwen3_moe"  # 8 experts, 2 a token (bridge/model/tiny_model.py)
    c.model.tiny_num_layers, c.model.tiny_hidden_size, c.model.tiny_intermediate_size = 2, 64, 128
    c.model.dtype = "float32"
    c.model.moe.routing_replay = "rollout"
    c.bridge.delta.enabled = "true"  # versions after the first ship as patches
    c.bridge.delta.anchor_every = 4
    c.rollout.temperature = 1.0
    c.rollout.eval_period = 0  # held-out accuracy at the start and the end only
    c.eval.on = "fleet"  # evaluation rows carry routing too, checked at intake
    c.task.reward_fn = "configs/rewards/digit_share.py:compute_score"
    # A reward_fn override is a closure the controller's own process cannot be pickled
    # with (bridge/control/process.py); in-process it is scored the same.
    c.controller.own_process = False
    c.task.eval_size = 1
    c.sft.steps = 0
    c.batch.groups_per_step = 2
    c.batch.samples_per_group = 4
    c.batch.micro_batch_size = 4
    c.batch.max_prompt_len = 16
    c.batch.max_answer_len = 24
    c.batch.packing = False  # recorded routing is [B, T]-aligned: replay runs unpacked
    c.checkpoint.interval = 100
    return c
