"""The RL phase's parts, each on its own; `learner_jax/train.py` wires them in one place.

    serve.py      the controller the binary hosts (SQLite state, cursor restored)
    weights.py    the weight store and publishing versions (canary, background thread)
    batches.py    controller groups -> learner batches, one per step
    evals.py      held-out accuracy, recorded in eval.jsonl
    swaps.py      when each worker first serves each version (swaps.jsonl, broadcast.jsonl)
    rescore.py    the audit's sampled re-score of rows tagged with older versions
    interrupt.py  Ctrl-C finishes the step; a second one aborts
    mirror.py     several processes: process 0 drives, the others replay its collectives
    hooks.py      the `AfterStep` protocol the RL loop calls after each update, and the
                  adapters that put the parts above behind it

No part imports another: what one needs from another (the controller, a callback, the
process-0 `mirror.Leader`) is handed in by the training binary.
"""
