"""The learning plane: the Flax policy, its training, and the binary that runs both.

Top level: `train.py` (the training binary, `python -m learner_jax.train`: SFT, then RL),
`learner.py` (`Learner`: the sharded state, the jitted steps and the checkpoints the
binary drives), `run_config.py` and `config_file.py` (what a config means for the learner,
and loading one by path), the publishing of weight versions (`publish.py`,
`background_publish.py`, LoRA's `lora.py`, `lora_state.py`, `lora_publish.py`), and the
commands kept at their documented paths (`evaluate.py`, `report.py`). The rooms, one
concept each:

- `model/`: the policy network and its numerics (forward, attention, log-probs under the
  sampler's truncation, KV decoding, sharding, HF import).
- `training/`: one update and what feeds it (train state and steps, losses, advantages,
  optimizer, batches, checkpoints).
- `evaluation/`: held-out evaluation, by the learner or by the fleet.
- `reporting/`: what a run shows and records (console, metrics files, report).
- `fleet/`: the binary's own rollout workers.
- `multihost/`: the learner as several processes.
- `rl/`: the RL phase's parts that `train.py` wires (the hosted controller, the batch
  stream, weight versions, the audit's re-score and exact check, healing, Ctrl-C, the
  after-step hooks).
"""
