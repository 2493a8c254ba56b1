"""How long a snapshot takes to reach each worker, by broadcast mode (PAPER.md's formulas,
per worker and with each worker's own bandwidth).

- store: every worker downloads all M bytes from the store / learner uplink U, which the
  concurrent downloads share fairly (max-min, each capped by its own bandwidth B_i); with
  equal B this is max(M / B, N * M / U), the one-to-many line of the paper. U = inf models
  an object store that scales with readers.
- chain: a pipeline learner -> w_1 -> ... -> w_N in chunks of c bytes, fastest first. Node k
  has the whole snapshot after the first chunk has crossed k links plus the rest at the
  slowest link so far: sum_{j<=k} c / r_j + (M - c) / min_{j<=k} r_j, with r_j =
  min(B_{j-1}, B_j) (r_1 = min(U, B_1)). Equal B: (M + (N - 1) c) / B for the last node.
- tree: fan-out f, fastest nodes nearest the learner; a node uploads to its f children at
  once, so a link runs at min(B_parent / f, B_child) and the same pipeline formula holds
  along the path. Equal B: about f (M + depth c) / B.

Links are full duplex and uplink = downlink = `bandwidth_mb_s`; per-chunk latency (alpha)
is left out. `period` says how soon the next snapshot can follow: a pipeline takes a new
version once its slowest link has passed the previous one (M / min rate), while the store's
shared uplink is busy until the last download ends.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MB = 1e6


def store_delays(model_bytes: float, bw_mb_s: Sequence[float], uplink_mb_s: float) -> list[float]:
    """Max-min fair sharing of the uplink among downloads that all start now."""
    n = len(bw_mb_s)
    left = [model_bytes / MB] * n  # MB still to fetch
    done = [0.0] * n
    active = set(range(n))
    now = 0.0
    while active:
        # Water-filling: the slowest-capped downloads take their cap, the rest split the rest.
        cap, rates = uplink_mb_s, {}
        for k, i in enumerate(sorted(active, key=lambda i: bw_mb_s[i])):
            share = cap / (len(active) - k)
            rates[i] = min(bw_mb_s[i], share)
            cap -= rates[i]
        dt = min(left[i] / rates[i] for i in active)
        now += dt
        for i in list(active):
            left[i] -= rates[i] * dt
            if left[i] <= 1e-9 * model_bytes / MB:
                done[i] = now
                active.discard(i)
    return done


def _path_finish(chunk: float, model: float, rates: Sequence[float]) -> float:
    """Time for a node to hold all `model` MB, pipelined in `chunk` MB over links `rates`."""
    return sum(chunk / r for r in rates) + (model - chunk) / min(rates)


def chain_delays(
    model_bytes: float, bw_mb_s: Sequence[float], uplink_mb_s: float, chunk_mb: float
) -> list[float]:
    model = model_bytes / MB
    chunk = min(chunk_mb, model)
    order = sorted(range(len(bw_mb_s)), key=lambda i: -bw_mb_s[i])
    out = [0.0] * len(bw_mb_s)
    rates, prev = [], uplink_mb_s
    for i in order:
        rates.append(min(prev, bw_mb_s[i]))
        prev = bw_mb_s[i]
        out[i] = _path_finish(chunk, model, rates)
    return out


def tree_delays(
    model_bytes: float, bw_mb_s: Sequence[float], uplink_mb_s: float, chunk_mb: float, fanout: int
) -> list[float]:
    model = model_bytes / MB
    chunk = min(chunk_mb, model)
    order = sorted(range(len(bw_mb_s)), key=lambda i: -bw_mb_s[i])
    out = [0.0] * len(bw_mb_s)
    path_rates: list[list[float]] = []  # by tree position
    for pos, i in enumerate(order):
        parent = pos // fanout - 1  # positions 0..f-1 hang off the learner
        up = uplink_mb_s if parent < 0 else bw_mb_s[order[parent]]
        rate = min(up / fanout, bw_mb_s[i])
        path = ([] if parent < 0 else path_rates[parent]) + [rate]
        path_rates.append(path)
        out[i] = _path_finish(chunk, model, path)
    return out


def delays(
    mode: str,
    model_bytes: float,
    bw_mb_s: Sequence[float],
    uplink_mb_s: float = math.inf,
    chunk_mb: float = 64.0,
    fanout: int = 4,
) -> list[float]:
    """Seconds from a snapshot's publication until each worker holds it."""
    if not bw_mb_s:
        return []
    if mode == "store":
        return store_delays(model_bytes, bw_mb_s, uplink_mb_s)
    if mode == "chain":
        return chain_delays(model_bytes, bw_mb_s, uplink_mb_s, chunk_mb)
    if mode == "tree":
        return tree_delays(model_bytes, bw_mb_s, uplink_mb_s, chunk_mb, fanout)
    raise ValueError(f"unknown broadcast mode {mode!r}")


def period(
    mode: str,
    model_bytes: float,
    bw_mb_s: Sequence[float],
    uplink_mb_s: float = math.inf,
    fanout: int = 4,
    delays_s: Sequence[float] = (),
) -> float:
    """Seconds before the next snapshot can enter the broadcast (see the module docstring)."""
    if not bw_mb_s:
        return 0.0
    model, slowest = model_bytes / MB, min(bw_mb_s)
    if mode == "chain":
        return model / min(uplink_mb_s, slowest)
    if mode == "tree":  # every uploading node splits its uplink over `fanout` children
        uploaders = sorted(bw_mb_s, reverse=True)[: max(1, -(-len(bw_mb_s) // fanout) - 1)]
        return model / min(uplink_mb_s / fanout, slowest, min(uploaders) / fanout)
    return max(delays_s, default=0.0)


def single_fetch_s(mode: str, model_bytes: float, bw_mb_s: float, uplink_mb_s: float) -> float:
    """A restarted worker catching up alone: from the store over the uplink, or from a peer."""
    link = min(bw_mb_s, uplink_mb_s) if mode == "store" else bw_mb_s
    return model_bytes / MB / link
