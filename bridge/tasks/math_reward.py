"""Math answer checking with math-verify (LaTeX/sympy equivalence), for any task.

    math_verify_score("\\frac{1}{2}", "so the answer is $0.5$")   # 1.0
    make_task("arithmetic", reward="math_verify")                # any task's reward replaced

`math_verify_score(gold, completion)` parses both sides (LaTeX, `\\boxed{}`, plain
expressions; the completion's last answer-looking expression) and returns 1.0 when they are
mathematically equal, else 0.0. `compute_score` is the same in verl's reward-function
convention, which is how `reward="math_verify"` plugs into `registry.make_task`.

math-verify's own timeouts use `signal.alarm`, which only works in a main thread and cannot
stop a sympy call stuck in C code; they are turned off here and the caller bounds the time
instead by running these functions in `reward_pool` (`guarded_call`). Call them directly
only where a hang is acceptable. math-verify is an optional extra, imported on first use.
"""

from __future__ import annotations

import functools
import logging
from typing import Any


@functools.cache
def _math_verify():
    try:
        import math_verify
    except ImportError as e:
        raise ImportError(
            "the math_verify reward needs math-verify: pip install 'math-verify>=0.9' "
            "(or the echo2 'tasks' extra)"
        ) from e
    # It warns once per process that its timeout is off; that is deliberate here (see above).
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    return math_verify


def math_verify_score(gold: str, completion: str) -> float:
    """1.0 when `completion`'s final answer equals `gold` mathematically, else 0.0."""
    mv = _math_verify()
    gold_parsed = mv.parse(gold, parsing_timeout=None)
    if not gold_parsed:
        # A bare reference like "1/2" or "x=3" may not parse as LaTeX; try it in math mode.
        gold_parsed = mv.parse(f"${gold}$", parsing_timeout=None)
    if not gold_parsed:
        raise ValueError(f"math-verify cannot parse the reference answer {gold!r}")
    pred = mv.parse(completion, parsing_timeout=None)
    if not pred:
        return 0.0
    return 1.0 if mv.verify(gold_parsed, pred, timeout_seconds=None) else 0.0


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **kwargs
) -> float:
    """`math_verify_score` under verl's reward-function signature."""
    return math_verify_score(ground_truth, solution_str)
