"""Held-out evaluation of the policy, by the learner or by the fleet.

`evaluate.py` (greedy accuracy with the Flax model, and the exact expected reward on a
task that has one), `evals.py` (the evaluations during RL, recorded in `<workdir>/eval.jsonl`),
`fleet_eval.py` (`eval.on=fleet`: the workers evaluate one published version) and
`eval_cli.py` (a checkpoint or HF directory on a benchmark file through local vLLM
workers; the command `python -m learner_jax.evaluate` runs it).
"""
