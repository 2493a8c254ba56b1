"""The demo task (configs/tiny_arith.py) with LoRA: the learner trains rank-16 adapters on
every projection (q, k, v, o, gate, up, down) over the frozen tiny base, in both the SFT
warm start and GRPO; checkpoints hold only the adapters plus a reference to the base.
Launch:

    python -m learner_jax.train --config=configs/tiny_arith_lora.py \
        --workdir=/tmp/echo2_lora

Learning rates are 10x the full-weight run's: adapters start at zero (lora_b = 0) and move
the policy through a rank-16 bottleneck scaled by alpha / rank, the usual LoRA practice.
The fleet receives adapter versions: the base once, then each version's PEFT adapter
(learner_jax/rl/adapter_versions.py); the workers serve them as vLLM LoRA adapters over
the base (rollout_gpu/adapter_swap.py).
Everything else is configs/tiny_arith.py.
"""

from learner_jax.config_file import base_config


def get_config():
    c = base_config(__file__, "tiny_arith")
    c.learner.lora.rank = 16
    c.learner.lora.alpha = 32.0
    c.learner.lora.target_modules = ("q", "k", "v", "o", "gate", "up", "down")
    c.learner.lora.dropout = 0.0
    c.optimizer.learning_rate *= 10
    c.sft.learning_rate *= 10
    return c
