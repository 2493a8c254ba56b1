"""A reasoning-gym dataset by name (bridge/tasks/reasoning_gym.py): basic_arithmetic with
two 1-2 digit terms and + or -, strict scoring, SFT on the dataset's answers then GRPO.
Launch:

    python -m learner_jax.train --config=configs/reasoning_gym_arith.py \
        --workdir=/tmp/echo2_rg

Any other dataset works the same way, e.g. `--config.task.dataset=chain_sum
--config.task.dataset_options='{"max_terms": 3}'` (prompts must fit batch.max_prompt_len
for the character-level tiny model; a real model via `--config.model.hf_dir` has room).
The completion is scored against the item reasoning-gym rebuilds from the prompt id, with
the last <answer>...</answer> (or the whole completion) as the answer; never partial credit.

Everything else is configs/tiny_arith.py.
"""

from learner_jax.config_file import base_config


def get_config():
    c = base_config(__file__, "tiny_arith")
    c.task = c.task.__class__()  # the arithmetic task's keys do not apply
    c.task.name = "reasoning_gym"
    c.task.dataset = "basic_arithmetic"
    # A JSON string, so the command line can replace it whole (--config.task.dataset_options).
    c.task.dataset_options = (
        '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, '
        '"operators": ["+", "-"], "allow_negation": false, "allow_parentheses": false}'
    )
    c.task.scoring = "strict"  # strict | exact | dataset (reasoning-gym's partial credit)
    c.task.template = "{question} "  # short: the tiny model's tokenizer is per character
    c.task.eval_size = 200
    c.task.reward_fn = ""
    c.batch.max_prompt_len = 24  # BOS + "Calculate 99 - 99. "
    c.batch.max_answer_len = 24  # "<answer>-98</answer>" + EOS (21 tokens)
    return c
