"""Cost-aware activation: the cheapest set of workers whose throughput covers the learner.

ECHO-2's fifth idea as a covering knapsack, solved exactly with HiGHS through
`scipy.optimize.milp`:

    minimize    sum_i price_i * x_i
    subject to  sum_i mu_i * x_i >= (1 + margin) * required,   x_i in {0, 1}

with mu_i the worker's measured rollouts/s and `required` the learner's need
(`bridge/control/fleet/capacity.py`). When even the whole fleet falls short, everything is active
and the decision says by how much it is short.

Hysteresis, so the set does not flap as throughput estimates wobble: the current set is
kept while it still covers `required * (1 + margin * keep_fraction)` and the optimum is not
cheaper than it by more than `min_saving` (a fraction of its price). Only then is the new
optimum taken.

Workers with no throughput measurement yet are passed in with `mu=None`: they are kept
active (they must lease to be measured) and their price counts, but not their throughput.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Offer:
    """One worker as activation sees it."""

    worker_id: str
    price_per_hour: float
    rollouts_per_s: float | None  # None = not measured yet


@dataclasses.dataclass(frozen=True)
class Decision:
    active: frozenset[str]
    standby: frozenset[str]
    required_rollouts_per_s: float
    active_rollouts_per_s: float
    price_per_hour: float  # of the active set
    shortfall_rollouts_per_s: float  # > 0: the whole fleet cannot cover the requirement
    kept_previous: bool  # hysteresis kept the previous set
    solve_s: float


def _cheapest_cover(prices: np.ndarray, mus: np.ndarray, need: float) -> np.ndarray:
    """Exact 0/1 covering knapsack; returns the chosen mask (all True if infeasible).

    Symmetry breaking makes it fast: among workers of equal price an optimal set can always
    take the fastest ones (swap a slower chosen one for a faster unchosen one: same price,
    more throughput), so within each price class sorted by speed x_j >= x_{j+1}. Without
    these rows HiGHS spends >10 s proving optimality on 2,000 workers of six GPU types with
    jittered throughputs; with them it proves it in well under a second.
    """
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    n = len(prices)
    if need <= 0:
        return np.zeros(n, bool)
    if mus.sum() < need:
        return np.ones(n, bool)
    order = np.lexsort((-mus, prices))  # by price, then fastest first
    p, mu = prices[order], mus[order]
    same = np.flatnonzero(p[:-1] == p[1:])  # pairs (j, j + 1) within one price class
    rows = np.repeat(np.arange(len(same)), 2)
    cols = np.stack([same, same + 1], axis=1).reshape(-1)
    vals = np.tile([1.0, -1.0], len(same))
    chain = coo_matrix((vals, (rows, cols)), shape=(len(same), n)).tocsr()
    constraints = [
        # Throughput scaled by the need: HiGHS's feasibility tolerance is absolute.
        LinearConstraint(mu[None, :] / need, lb=1.0 - 1e-9, ub=np.inf),
    ]
    if len(same):
        constraints.append(LinearConstraint(chain, lb=0.0, ub=np.inf))
    res = milp(
        c=p,
        constraints=constraints,
        integrality=np.ones(n),
        bounds=Bounds(0, 1),
        options={"mip_rel_gap": 0.0, "time_limit": 10.0},
    )
    if res.x is None:  # cannot happen for a feasible cover; never leave the learner idle
        return np.ones(n, bool)
    mask = np.zeros(n, bool)
    mask[order] = res.x > 0.5
    return mask


def decide(
    offers: Sequence[Offer],
    required_rollouts_per_s: float,
    margin: float = 0.1,
    previous: Iterable[str] | None = None,
    keep_fraction: float = 0.5,
    min_saving: float = 0.1,
) -> Decision:
    """Choose the active set (see the module docstring)."""
    t0 = time.perf_counter()
    if margin < 0 or required_rollouts_per_s < 0:
        raise ValueError(
            f"need margin >= 0 and requirement >= 0, got {margin}, {required_rollouts_per_s}"
        )
    for o in offers:
        if o.price_per_hour < 0 or (o.rollouts_per_s is not None and o.rollouts_per_s < 0):
            raise ValueError(f"worker {o.worker_id}: negative price or throughput")
    unmeasured = [o for o in offers if o.rollouts_per_s is None]
    measured = [o for o in offers if o.rollouts_per_s is not None]
    prices = np.array([o.price_per_hour for o in measured], float)
    mus = np.array([o.rollouts_per_s for o in measured], float)
    need = (1.0 + margin) * required_rollouts_per_s
    chosen = _cheapest_cover(prices, mus, need)
    best = {o.worker_id for o, c in zip(measured, chosen, strict=True) if c}

    kept = False
    if previous is not None:
        prev = set(previous) & {o.worker_id for o in measured}
        prev_mu = sum(o.rollouts_per_s for o in measured if o.worker_id in prev)
        prev_price = sum(o.price_per_hour for o in measured if o.worker_id in prev)
        best_price = float(prices[chosen].sum())
        covers = prev_mu >= (1.0 + margin * keep_fraction) * required_rollouts_per_s
        if prev and covers and best_price >= prev_price * (1.0 - min_saving):
            best, kept = prev, True

    active = best | {o.worker_id for o in unmeasured}
    active_mu = sum(o.rollouts_per_s or 0.0 for o in offers if o.worker_id in active)
    return Decision(
        active=frozenset(active),
        standby=frozenset(o.worker_id for o in offers) - frozenset(active),
        required_rollouts_per_s=required_rollouts_per_s,
        active_rollouts_per_s=active_mu,
        price_per_hour=sum(o.price_per_hour for o in offers if o.worker_id in active),
        shortfall_rollouts_per_s=max(0.0, required_rollouts_per_s - float(mus.sum())),
        kept_previous=kept,
        solve_s=time.perf_counter() - t0,
    )
