"""Per-token checks of a submission as array operations, not Python loops.

A maximum-size submission is ~1 M completion tokens. Each check that walks them in Python
(a bound per id, a finite log-prob, versions that never decrease, a hidden id per token)
costs the controller ~0.1-1 s of GIL-held time per pass, and the heartbeats of every
worker wait behind it (docs/design/request-bodies.md). These helpers read a token list as
one numpy array (one C-level conversion) and answer the same question with vector
operations: where the first offending entry is, if any. The messages built from the answer
quote the original list's entry, so they read exactly as the per-token checks' did.

A list that does not fit the array's type (an int past int64) and a short one are answered
by the per-token loop instead: for a short list an array's fixed cost (~4 us a call, 3-6
calls a check) is more than the loop over it below `ARRAY_MIN` entries. `int_array` says
None where a list does not fit, for callers with their own per-token path.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

_FALLBACK = (OverflowError, TypeError, ValueError)
# The three validation checks of one completion, Python pass vs arrays (`timeit`, one core):
# 3 tokens 1.3 vs 12 us, 64 tokens 7 vs 15 us, 128 tokens 13 vs 18 us, 512 tokens 48 vs 38 us.
# Short completions are the common case (a fleet's answers, the load benches), so below the
# crossover the arrays' per-call cost would be most of a submission's CPU (bench.controller_cpu).
ARRAY_MIN = 256


def short(values: Sequence) -> bool:
    """Whether `values` is answered faster by a Python pass than by arrays."""
    return len(values) < ARRAY_MIN


def int_array(values: Sequence[int]) -> np.ndarray | None:
    """`values` as int64, or None where one does not fit (the caller's per-token path)."""
    try:
        return np.asarray(values, dtype=np.int64)
    except _FALLBACK:
        return None


def first(flags: np.ndarray) -> int | None:
    """The index of the first True of `flags`, or None."""
    at = int(np.argmax(flags)) if flags.size else 0
    return at if flags.size and flags[at] else None


def first_outside(ids: Sequence[int], low: int, high: int) -> int | None:
    """The index of the first id not in [low, high), None if all are."""
    a = None if short(ids) else int_array(ids)
    if a is None:  # short, or past int64: the per-token loop
        return next((k for k, i in enumerate(ids) if not low <= i < high), None)
    return first((a < low) | (a >= high))


def first_bad_logprob(logprobs: Sequence[float]) -> int | None:
    """The index of the first log-prob that is not finite and <= 0, None if none."""
    a = None
    if not short(logprobs):
        try:
            a = np.asarray(logprobs, dtype=np.float64)
        except _FALLBACK:
            pass
    if a is None:  # short, or not a float64 array: the per-token loop
        bad = (k for k, x in enumerate(logprobs) if not (math.isfinite(x) and x <= 0.0))
        return next(bad, None)
    with np.errstate(invalid="ignore"):
        return first(~(np.isfinite(a) & (a <= 0.0)))


def version_span(versions: Sequence[int]) -> tuple[int, int, bool]:
    """(lowest, highest, whether some version is below the one before it) of a non-empty
    list."""
    a = None if short(versions) else int_array(versions)
    if a is None:  # short, or past int64: one pass each
        down = any(b < a for a, b in zip(versions, versions[1:], strict=False))
        return min(versions), max(versions), down
    return int(a.min()), int(a.max()), bool(np.any(a[1:] < a[:-1]))
