"""pass@k, the unbiased estimator (Chen et al. 2021, "Evaluating Large Language Models
Trained on Code", eq. 1): with n samples of a prompt of which c are correct,

    pass@k = 1 - C(n - c, k) / C(n, k)

the probability that k samples drawn without replacement from the n hold at least one
correct one, averaged over prompts. The ratio is computed as the product
prod_{i = n - c + 1}^{n} (1 - k / i), which never forms the (huge) binomials. k <= n.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with `c` correct among `n` samples."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float:
    """pass@k averaged over prompts, each given as (n samples, c correct)."""
    values = [pass_at_k(n, c, k) for n, c in counts]
    if not values:
        raise ValueError("pass@k of no prompts")
    return sum(values) / len(values)


def parse_ks(text: str | Sequence[int], n: int) -> list[int]:
    """'1,8' -> [1, 8], each checked against n (k <= n)."""
    ks = [int(x) for x in text.split(",")] if isinstance(text, str) else [int(x) for x in text]
    bad = [k for k in ks if not 1 <= k <= n]
    if not ks or bad:
        raise ValueError(f"k must be in 1..n={n}, got {ks}")
    return sorted(set(ks))
