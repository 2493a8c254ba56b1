"""draft"""

from learner_jax.config_file import base_config


def get_config():
    c = base_config(__file__, "reasoning_gym_arith")
    c.local_workers = 1
    c.task.dataset = "spell_backward"
    c.task.dataset_options = '{"max_word_len": 5, "min_word_len": 3}'
    c.batch.max_prompt_len = 56
    c.batch.max_answer_len = 24
    c.batch.groups_per_step = 8
    c.batch.samples_per_group = 8
    c.sft.steps = 160
    c.total_steps = 150
    c.optimizer.learning_rate = 1e-4
    c.optimizer.warmup_steps = 10
    c.eval.n = 1
    c.rollout.eval_period = 10
    c.checkpoint.interval = 50
    return c
