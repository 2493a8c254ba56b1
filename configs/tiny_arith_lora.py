"""The demo task (configs/tiny_arith.py) with LoRA: the learner trains rank-16 adapters on
every projection (q, k, v, o, gate, up, down) over the frozen tiny base, in both the SFT
warm start and GRPO; checkpoints hold only the adapters plus a reference to the base.
Launch:

    python -m learner_jax.train --config=configs/tiny_arith_lora.py \
        --workdir=/tmp/echo2_lora

LoRA is for a trained base. On the tiny RANDOM base this config builds by default, the
frozen tied embedding (std 0.02) and final norm cap the logits (|h| = sqrt(128), |e| ~ 0.23:
a logit gap of ~5 at most), so adapter-only SFT stalls at loss ~3.6 (full weights: ~1.5 by
step 80) and held-out accuracy stays 0 (BUILD_NOTES.md, issue 28). The demo trains the
adapters with RL over the full run's SFT policy, exported as an HF directory:

    python -m learner_jax.train --config=configs/tiny_arith.py --workdir=/tmp/f \
        --config.checkpoint.keep=10
    python -m bridge.export --checkpoint_dir=/tmp/f/checkpoints --step=2000 \
        --output_dir=/tmp/f_sft
    python -m learner_jax.train --config=configs/tiny_arith_lora.py --workdir=/tmp/l \
        --config.model.hf_dir=/tmp/f_sft --config.sft.steps=0

`python -m bench.lora --out=F.json --demo_root=DIR --noswap --layers=4 --hidden=128` runs
those commands (SFT once, then full RL and LoRA RL from the same export, 300 RL steps each)
and prints them side by side: both reach the demo's held-out band (BUILD_NOTES.md, issue 28,
"The demo band").

Learning rates are 10x the full-weight run's: adapters start at zero (lora_b = 0) and move
the policy through a rank-16 bottleneck scaled by alpha / rank, the usual LoRA practice.
Measured with the demo's RL settings otherwise unchanged, this reaches the band (held-out
0.98 by RL step 60); nothing else needed tuning.
The fleet receives adapter versions: the base once, then each version's PEFT adapter
(bridge/weights/adapter.py); the workers serve them as vLLM LoRA adapters over
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
