"""Relay topology: who fetches a version from whom (pure data, no I/O).

Modes (config key `bridge.broadcast`; "auto", the demo's default, is resolved by
`resolve_mode` before a topology is built):
  store  every worker reads the store (one-to-many; the store's uplink carries N copies)
  chain  store -> w0 -> w1 -> ...: each node uploads one copy; with chunk c and per-link
         bandwidth B a version of M bytes reaches N nodes in about (M + (N-1)c)/B
  tree   store -> w0, then each node feeds f more (heap order); depth ~log_f N, but each
         node's uplink is split f ways: about f(M + depth*c)/B

Placement is an order of nodes laid out in heap order under the store (the virtual root).
`rebuild` sorts by delivery measured at the children or by the controller's own probe of
the node's relay (`rank_rate`), fastest first, so fast uplinks sit near the root where they
feed the most. A worker's declared uplink is a claim, never a rank: it only caps what was
measured. Once any node has been measured to deliver, only such nodes relay: an unmeasured
newcomer (whatever it declares) and a node measured to deliver nothing are leaves, like an
excluded node, until a measurement says otherwise (bridge/broadcast/state.py probes them).
Before anything is measured (a fleet's first version) every node relays in join order:
someone must go first, and the declarations order no one. `join` appends (a new node lands
at a leaf and moves no one); `remove` drops a node from the order, so in a chain its child
now hangs from its grandparent.
Every placement lists fallbacks (grandparent, great-grandparent ... ) and the store is
always the last resort. Nodes excluded for serving bad bytes never relay to anyone: they
hang as extra leaves. Leaves spread over the relays by measured uplink per child
(`_leaf_parent`), so a crowd of them does not share one relay's uplink.
"""

from __future__ import annotations

import dataclasses

MODES = ("store", "chain", "tree")
CONFIG_MODES = ("auto", *MODES)
LOCAL_DRIVERS = ("file", "memory")  # stores that only workers on the learner's machine read


def resolve_mode(mode: str, store_driver: str) -> str:
    """The broadcast mode for `bridge.broadcast=mode` with a store of kvstore `store_driver`.

    "auto": "store" when the store is this machine's disk or memory, else "chain". A local
    store is read at disk speed by workers on the same machine, so a relay hop only adds
    latency (and CPU on a box the workers share: measured on the 2-core demo, BUILD_NOTES
    "Broadcast mode auto"); a remote store (s3, gcs) is where the store's uplink carrying one
    copy per worker is the bottleneck that the chain removes."""
    if mode not in CONFIG_MODES:
        raise ValueError(f"bridge.broadcast must be one of {CONFIG_MODES}, got {mode!r}")
    if mode != "auto":
        return mode
    return "store" if store_driver in LOCAL_DRIVERS else "chain"


MAX_FALLBACKS = 2  # relays before the store; each one more is one more stalled timeout


@dataclasses.dataclass
class Node:
    node_id: str
    relay_url: str = ""
    up_bytes_per_s: float = 0.0  # the worker's own figure: only an upper bound; 0 = unknown
    down_bytes_per_s: float = 0.0
    # What its children (or the controller's probe) measured receiving from it
    # (bridge/broadcast/state.py); None = not measured yet, 0.0 = measured to deliver nothing.
    delivered_bytes_per_s: float | None = None


def rank_rate(node: Node) -> float | None:
    """The uplink a node is placed by: what was measured receiving from it, capped by its
    own declaration; None = not measured yet (a declaration alone places no one)."""
    if node.delivered_bytes_per_s is None:
        return None
    declared = node.up_bytes_per_s if node.up_bytes_per_s > 0 else float("inf")
    return min(declared, node.delivered_bytes_per_s)


def _rank_key(node: Node) -> tuple[int, float]:
    """Sort key: measured to deliver (fastest first), then unmeasured, then measured to
    deliver nothing (stable sort: ties keep join order)."""
    rate = rank_rate(node)
    if rate is None:
        return (1, 0.0)
    return (0, -rate) if rate > 0 else (2, 0.0)


@dataclasses.dataclass(frozen=True)
class Placement:
    parent: str | None  # node id; None = the store
    parent_url: str | None
    fallback_urls: tuple[str, ...]  # relays to try after the parent, before the store
    depth: int  # 1 = fed by the store


class Topology:
    def __init__(self, mode: str = "store", fanout: int = 2):
        if mode not in MODES:
            raise ValueError(f"bridge.broadcast must be one of {MODES}, got {mode!r}")
        if fanout < 1:
            raise ValueError(f"fanout must be >= 1, got {fanout}")
        self.mode = mode
        self.fanout = 1 if mode == "chain" else fanout
        self.nodes: dict[str, Node] = {}
        self.order: list[str] = []  # healthy nodes in heap order
        self.excluded: set[str] = set()
        # The nodes that relay (a prefix of `order`), fixed at `rebuild`: every node until
        # one has been measured to deliver, then only those (module docstring).
        self.relaying: set[str] = set()
        self.bootstrap = True
        self.leaf_parents: dict[str, str] = {}  # leaf -> the relay it hangs from (_leaf_parent)

    # -- membership ---------------------------------------------------------------------
    def join(self, node: Node) -> None:
        """Add or update a node; a new one attaches at a leaf (the end of the order)."""
        known = node.node_id in self.nodes
        self.nodes[node.node_id] = node
        if not known and node.node_id not in self.excluded:
            self.order.append(node.node_id)
            if self.bootstrap:
                self.relaying.add(node.node_id)

    def remove(self, node_id: str) -> None:
        """A node left or died: its subtree re-hangs from its ancestors."""
        self.nodes.pop(node_id, None)
        self.excluded.discard(node_id)
        self.relaying.discard(node_id)
        if node_id in self.order:
            self.order.remove(node_id)

    def exclude(self, node_id: str) -> None:
        """Never let `node_id` relay again (it served bad bytes); it still gets versions."""
        self.relaying.discard(node_id)
        if node_id in self.order:
            self.order.remove(node_id)
        if node_id in self.nodes:
            self.excluded.add(node_id)

    def rebuild(self) -> None:
        """Re-sort by `_rank_key` (measured delivery, fastest first) and fix who relays."""
        self.order.sort(key=lambda n: _rank_key(self.nodes[n]))
        delivering = {n for n in self.order if (rank_rate(self.nodes[n]) or 0.0) > 0}
        self.bootstrap = not delivering
        self.relaying = set(self.order) if self.bootstrap else delivering
        self.leaf_parents.clear()  # re-spread under the new ranking

    # -- placement ----------------------------------------------------------------------
    def _parent_index(self, i: int) -> int | None:
        """Heap parent of order position i (None = the store)."""
        if self.mode == "store":
            return None
        if i == 0:  # the store feeds one node, whatever f: its uplink carries one copy
            return None
        return (i - 1) // self.fanout

    def placement(self, node_id: str) -> Placement:
        if node_id not in self.relaying:
            if node_id not in self.nodes:
                raise KeyError(f"unknown node {node_id!r}")
            # Excluded, unmeasured or measured to deliver nothing: a leaf under a relay
            # (or the store).
            relays = [n for n in self.order if n in self.relaying]
            if self.mode == "store" or not relays:
                return Placement(None, None, (), 1)
            parent = self._leaf_parent(node_id, relays)
            up = self.placement(parent)
            chain = (self.nodes[parent].relay_url, up.parent_url or "", *up.fallback_urls)
            urls = tuple(u for u in chain if u)
            return Placement(parent, urls[0], urls[1 : 1 + MAX_FALLBACKS], up.depth + 1)
        ancestors = []
        i = self.order.index(node_id)
        while (i := self._parent_index(i)) is not None:
            ancestors.append(self.order[i])
        urls = [self.nodes[a].relay_url for a in ancestors]
        if not ancestors:
            return Placement(None, None, (), 1)
        return Placement(
            ancestors[0],
            urls[0],
            tuple(u for u in urls[1 : 1 + MAX_FALLBACKS] if u),
            len(ancestors) + 1,
        )

    def _leaf_parent(self, node_id: str, relays: list[str]) -> str:
        """The relay a leaf hangs from, kept until the next `rebuild`. Each new leaf goes
        where it gets the largest share of an uplink: the relay with the least measured rate
        per child (its heap children plus the leaves given it), so many leaves (workers
        behind NAT, newcomers of a large join) spread over the relays in proportion to
        their uplinks instead of sharing one. Before anything is measured all rates count
        as equal."""
        parent = self.leaf_parents.get(node_id)
        if parent in self.relaying:
            return parent
        load = dict.fromkeys(relays, 0)
        for i in range(1, len(relays)):
            load[relays[self._parent_index(i)]] += 1
        for leaf, p in self.leaf_parents.items():
            if p in load and leaf in self.nodes:
                load[p] += 1

        def share(i_r):
            i, r = i_r
            rate = rank_rate(self.nodes[r]) or 1.0
            return (-(rate / (load[r] + 1)), -i)  # ties: the deepest relay, as before

        parent = min(enumerate(relays), key=share)[1]
        self.leaf_parents[node_id] = parent
        return parent

    def placements(self) -> dict[str, Placement]:
        return {n: self.placement(n) for n in self.nodes}
