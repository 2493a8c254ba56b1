"""The RL phase's parts, each on its own; `learner_jax/train.py` wires them in one place.

    serve.py             the controller the binary hosts (SQLite state, cursor restored)
    weights.py           the weight store and publishing versions (canary, background thread)
    adapter_versions.py  a LoRA run's versions: the base once, then each adapter alone
    batches.py           controller groups -> learner batches, one per step
    swaps.py             when each worker first serves each version (swaps.jsonl, broadcast.jsonl)
    rescore.py           the audit's sampled re-score of rows tagged with older versions
    audit_focus.py       where the re-score spends its rows: the workers it knows least
    exact_check.py       every consumed token recomputed under its version and seed
    heal.py              a version the workers cannot load, healed while the learner waits
    interrupt.py         Ctrl-C finishes the step; a second one aborts
    hooks.py             the `AfterStep` protocol the RL loop calls after each update, and
                         the adapters that put the parts above behind it

The RL evaluations (`evals.py`, `fleet_eval.py`) are in learner_jax/evaluation/, the fleet
follower in learner_jax/fleet/, the processes' mirror in learner_jax/multihost/. What a
part needs at run time from another (the controller, a callback, the process-0
`mirror.Leader`) is handed in by the training binary.
"""
