"""What a run shows and records: the terminal, the metrics files and the report.

`console.py` (the terminal and `<workdir>/train.log`), `metrics.py` (`metrics.jsonl` and
TensorBoard), `wandb_sink.py` (Weights & Biases beside them), `report.py` (the live line
per step and the end-of-run report; `python -m learner_jax.report` re-draws it) and
`compiles.py` (XLA compiles counted, so a one-off compile is not read as a cost per
update).
"""
