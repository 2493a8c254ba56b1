"""The worker's half of the per-version canary: score the manifest's probes with the engine.

What the canary is, its criteria and the payload format live in
`bridge/contracts/canary.py` (numpy, shared with the learner, which builds the payload).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from bridge.contracts.canary import CanaryResult, compare
from rollout_gpu.engine import RolloutEngine


def engine_prompt_logprobs(
    engine: RolloutEngine, token_lists: Sequence[Sequence[int]]
) -> list[np.ndarray]:
    """The engine's log-prob of every prompt token given its prefix: one [T-1] array per list.

    Prompt log-probs skip the sampler's processors (temperature, top-k, penalties), so
    they are the model's raw log-softmax whatever the sampling settings; only the
    `raw_logits`/`processed_logits` modes would return logits instead, which we refuse.
    """
    mode = engine.logprobs_mode
    if not mode.endswith("logprobs"):
        raise ValueError(f"engine logprobs_mode={mode!r} returns logits, not log-probs")
    return engine.prompt_logprobs(token_lists)


def check_canary(engine: RolloutEngine, canary: Mapping, dtype: str) -> CanaryResult:
    """Score the payload's probes with the engine and compare with the learner's log-probs."""
    try:
        token_lists, learner = canary["token_lists"], canary["logprobs"]
    except (KeyError, TypeError) as e:
        raise ValueError(f"malformed canary payload (need token_lists, logprobs): {e!r}") from e
    if len(token_lists) != len(learner):
        raise ValueError("malformed canary payload: token_lists and logprobs differ in length")
    return compare(engine_prompt_logprobs(engine, token_lists), learner, dtype)
