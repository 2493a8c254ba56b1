"""Default config: tiny Qwen3 model, synthetic arithmetic task, local learner + workers.

Runs anywhere (one device, CPU is enough). Launch:

    python -m learner_jax.train --config=configs/tiny_arith.py --workdir=/tmp/echo2_demo

Override any key on the command line, e.g. a sharded run on 8 virtual CPU devices:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m learner_jax.train --config=configs/tiny_arith.py --workdir=/tmp/echo2_demo \
        --config.mesh.data=2 --config.mesh.fsdp=2 --config.mesh.tensor=2

Every key, its default and its doc is declared once in bridge/config/keys.py (the generated
reference: docs/reference/config.md); this file sets only what the demo chooses otherwise.
"""

from ml_collections import ConfigDict

from bridge.config.keys import default_config


def get_config() -> ConfigDict:
    c = default_config()
    # The library's optimizer and loss defaults are the published algorithms' (lr 1e-6,
    # Adam's b2 0.999, GRPO's symmetric clip); the tiny demo model trains with its own. On
    # the 4 x 128 policy 1e-4 takes held-out accuracy from 6.5% to 100% in ~120 steps.
    c.optimizer.learning_rate = 1e-4
    c.optimizer.warmup_steps = 20
    c.optimizer.b2 = 0.99
    c.loss.clip_eps_high = 0.28  # clip-higher (DAPO)
    c.checkpoint.interval = 20  # 15 saves over the demo's 300 steps; long runs keep 100
    # The demo fleet: worker i takes prices[i % 2], throttle_s[i % 2], a fast $0.40/h
    # worker and a slow (throttled) $0.15/h one, so activation has a choice to make.
    c.fleet.prices = (0.40, 0.15)
    c.fleet.throttle_s = (0.0, 0.5)

    # The arithmetic task's own options (bridge/tasks/arithmetic.py). SFT warm start (the
    # sft.* defaults: 2000 steps x 64 pairs, ~3 min CPU) from a sloppy teacher that answers
    # one too high 70% of the time (sft_label_noise). The policy learns the arithmetic and
    # the habit: greedy held-out accuracy 6.5%, while it samples the right answer ~25% of
    # the time. With clean labels (sft_label_noise=0) the same SFT alone reaches ~90%, which
    # leaves RL nothing to show; the sloppy teacher is the demo's stand-in for imperfect
    # demonstrations that RL against an exact verifier corrects.
    c.task.digits = 2
    c.task.ops = "+-"
    c.task.sft_label_noise = 0.7
    c.task.format_reward = 0.0  # reward for a wrong answer that at least starts with a number
    c.task.eval_every = 10  # held-out split: 1 problem in eval_every is never trained on
    c.task.eval_size = 200
    return c
