"""Contracts both stacks must compute identically, each in one place (numpy only).

`canary.py` (probe sequences, payload, comparison criteria), `prompt.py` (prompt token
ids: plain BOS + text, or the tokenizer's chat template rendered with jinja2), `k3.py`
(the KL estimate behind `mismatch/kl` and the canary), `staleness.py` (which versions may
be leased, admitted and consumed: the controller, the planner and the learner's checks).
"""
