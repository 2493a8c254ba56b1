"""A reasoning-gym task that is not arithmetic (issue 27): spell_backward, "Spell this word
backward (example: sun -> nus): burg" -> "grub", words of 3-5 letters from reasoning-gym's
word list (16,772 words; the 200 held-out words are never trained on), strict scoring
(the whole answer, case-insensitive as reasoning-gym's scorer, no partial credit).
Launch:

    python -m learner_jax.train --config=configs/reasoning_gym_spell_backward.py \
        --workdir=/tmp/echo2_spell [--config.seed=1]

Recipe: the tiny character-level model (4 x 128), 160 SFT steps on the dataset's answers
(deliberately short: SFT learns this task in a sudden jump between ~100 and ~200 steps, so
160 stops it part way for some seeds), then 150 GRPO steps at lr 1e-4 with one local worker
(8 prompts x 8 samples per step). Untrained the model scores 0.0 on the held-out words.

Measured (shared 2-core box, BUILD_NOTES.md "reasoning-gym beyond arithmetic"), held-out
greedy accuracy on 200 words, untrained -> after SFT -> after RL, whole run wall time:
  seed 0: 0.0 -> 0.480 -> 0.670 (SFT +48 points, RL +19), 14.1 min at load 10-17
  seed 1: 0.0 -> 0.850 -> 0.830 (SFT +85, RL -2),          14.2 min at load 7-22
  seed 2: 0.0 -> 0.680 -> 0.745 (SFT +68, RL +6.5),         12.9 min at load 12-19
+25 points is reached by SFT alone in every seed (at the end of SFT, 5-9 min in); RL's
part shrinks the further SFT got in its jump (seed 0 +19, seed 2 +6.5, seed 1 none; at
T = 1, RL raised the sampled reward in all three: 0.21 -> 0.25, 0.34 -> 0.44, 0.53 ->
0.62). Shorter SFT (130 steps: 0.16) left RL too few right samples and at lr 3e-4 it
collapsed to 0.
Control (seed 0, SFT only): from the same 0.48, 50 more SFT steps reach 0.775 and 100
reach 0.850, in 91 s; on this task imitation of right answers beats RL per step and per
second. What this config shows is the whole pipeline (SFT, fleet, GRPO on a strict
verifier) clearing +25 in <= 15 minutes, with RL's part measured, not RL doing the +25.

configs/reasoning_gym_spell_backward_sloppy.py is the same task with a sloppy SFT teacher,
where RL does the +25 (and +74 to +85 points) in about 4 minutes.

Everything else is configs/reasoning_gym_arith.py and configs/tiny_arith.py.
"""

from learner_jax.config_file import base_config


def get_config():
    c = base_config(__file__, "reasoning_gym_arith")
    c.local_workers = 1  # one vLLM worker: the box has 2 cores
    c.task.dataset = "spell_backward"
    c.task.dataset_options = '{"max_word_len": 5, "min_word_len": 3}'
    c.batch.max_prompt_len = 56  # BOS + the 48-character instruction + the word + " "
    c.batch.max_answer_len = 24  # "<answer>" + 5 letters + "</answer>" + EOS = 23
    c.batch.groups_per_step = 8
    c.batch.samples_per_group = 8
    c.sft.steps = 160
    c.total_steps = 150
    c.optimizer.learning_rate = 1e-4
    c.optimizer.warmup_steps = 10
    c.eval.n = 1  # greedy: one sample per prompt says it all
    c.rollout.eval_period = 10
    c.checkpoint.interval = 50
    return c
