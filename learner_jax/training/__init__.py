"""One update and what feeds it: the train state, the jitted steps, the losses and their
inputs, the optimizer, the checkpoints.

`train_state.py` (params, optimizer state, step, RNG, built already sharded),
`train_step.py` (the jitted RL and SFT steps over micro-batches), `losses.py` (the
policy-gradient losses, by name), `advantages.py` (group estimators and the DAPO filter),
`optim.py` (clipping, AdamW, warmup + cosine), `reference_policy.py` (the frozen policy of
the KL penalty), `diagnostics.py` (training-health metrics), `checkpoint.py` (orbax
checkpoints with the controller's cursor). The batches: `rollout_batch.py` (controller
groups -> RL rows), `sft_data.py` (the warm start's rows) and `packing.py` (several
sequences per row).
"""
