"""Small, fast variant of tiny_arith for tests: a few SFT steps, tiny batches, no workers.

python -m learner_jax.train --config=configs/test_tiny.py --workdir=/tmp/echo2_test
"""

from learner_jax.config_file import base_config


def get_config():
    c = base_config(__file__, "tiny_arith")
    c.total_steps = 0
    c.local_workers = 0
    c.model.tiny_num_layers, c.model.tiny_hidden_size, c.model.tiny_intermediate_size = 2, 64, 128
    c.batch.groups_per_step = 2
    c.batch.samples_per_group = 4
    c.batch.micro_batch_size = 4
    c.batch.max_prompt_len = 8
    c.batch.max_answer_len = 4
    c.sft.steps = 2
    c.sft.batch_size = 8
    c.sft.micro_batch_size = 4
    c.sft.warmup_steps = 0
    c.checkpoint.interval = 2
    c.checkpoint.keep = 2
    return c
