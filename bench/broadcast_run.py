"""One timed broadcast of a version from an origin relay to N relays (chain, tree or every
relay reading the origin), and the models and the Kumar & Ross lower bound it is compared
against (PAPER.md). No absl flags here: the tests import it beside other benches' flags.
"""

from __future__ import annotations

import time

from bench import relay_procs
from bridge.broadcast import topology as topo
from rollout_gpu.peer_fetch import sources_for


def run_once(origin: str, relays: list[str], mode: str, fanout: int, version: int = 1) -> dict:
    """Order every relay to fetch `version` along the topology (origin at the root) and
    wait until all hold it verified: seconds from the orders to the last completion, the
    origin's bytes served, the tree depth and each receiver's own fetch seconds."""
    t = topo.Topology(mode, fanout)
    for i, url in enumerate(relays):
        t.join(topo.Node(f"r{i}", url))
    for url in relays:
        relay_procs.call(url, "/forget", {"version": version})
    sha = relay_procs.manifest_sha(origin, version)
    before = relay_procs.call(origin, "/status")["bytes_up"]
    t0 = time.time()
    depth = 1
    for i, url in enumerate(relays):
        p = t.placement(f"r{i}")
        depth = max(depth, p.depth)
        srcs = sources_for(p.parent_url, p.fallback_urls, origin)
        relay_procs.call(url, "/fetch", {"version": version, "sources": srcs,
                                         "manifest_sha256": sha})  # fmt: skip
    done: dict[str, dict] = {}
    while len(done) < len(relays):
        time.sleep(0.05)
        for url in relays:
            v = relay_procs.call(url, "/status")["versions"].get(str(version))
            if v and v["failed"]:
                raise RuntimeError(f"{url}: {v['failed']}")
            if v and v["complete"]:
                done[url] = v
        if time.time() - t0 > 900:
            raise RuntimeError("broadcast did not finish in 15 min")
    origin_bytes = relay_procs.call(origin, "/status")["bytes_up"] - before
    # Each receiver's own fetch time: a link running at B takes M / B of it.
    own_s = [max(1e-9, v["completed_at"] - v["started_at"]) for v in done.values()]
    return {
        "seconds": max(v["completed_at"] for v in done.values()) - t0,
        "store_bytes": origin_bytes,
        "depth": depth,
        "fetch_s": own_s,
    }


def ideals(mode: str, n: int, m: float, c: float, b: float, f: int, depth: int, s: float) -> dict:
    """The models' seconds for M = `m` bytes to `n` receivers (uplinks `b`, the store's `s`,
    chunk `c`, fan-out `f`) and the Kumar & Ross lower bound (PAPER.md; downlinks free)."""
    one_to_many = n * m / s
    kumar_ross = max(m / s, n * m / (s + n * b))
    # Relays throttle uploads only: one receiver reads the store at s; with more, the chain
    # (or tree) runs at its slowest link, min(s, B).
    first = m / (s if n == 1 else min(s, b))
    model = {
        "store": one_to_many,
        "chain": first + (n - 1) * c / b,
        "tree": first if n == 1 else first + ((min(f, n - 1) - 1) * m + (depth - 1) * c) / b,
    }[mode]
    return {"model_s": model, "kumar_ross_s": kumar_ross, "one_to_many_s": one_to_many}
