"""Relay topology: heap placement, ordering by uplink, join at a leaf, removal, exclusion."""

import pytest

from bridge.broadcast.topology import Node, Topology


def make(mode, n, fanout=2, rates=None):
    t = Topology(mode, fanout)
    for i in range(n):
        t.join(Node(f"w{i}", f"http://r{i}", up_bytes_per_s=(rates or [0] * n)[i]))
    return t


def parents(t):
    return {n: p.parent for n, p in t.placements().items()}


def test_store_mode_reads_the_store():
    t = make("store", 3)
    assert all(p.parent is None and not p.fallback_urls for p in t.placements().values())


def test_chain_with_grandparent_fallback():
    t = make("chain", 4)
    assert parents(t) == {"w0": None, "w1": "w0", "w2": "w1", "w3": "w2"}
    p = t.placement("w3")
    assert p.parent_url == "http://r2" and p.fallback_urls == ("http://r1", "http://r0")
    assert p.depth == 4


def test_tree_store_feeds_one_root_then_fanout():
    t = make("tree", 7, fanout=3)
    assert parents(t) == {
        "w0": None, "w1": "w0", "w2": "w0", "w3": "w0", "w4": "w1", "w5": "w1", "w6": "w1",
    }  # fmt: skip


def test_rebuild_puts_fastest_measured_uplinks_near_the_root():
    t = make("chain", 5, rates=[1e6, 9e6, 5e6, 1e13, 1e13])
    for node, delivered in zip(t.order, [1e6, 9e6, 8e6, None, 0.0], strict=True):
        t.nodes[node].delivered_bytes_per_s = delivered
    t.rebuild()
    # Measured (capped by the declaration: w2 declared 5e6), then unmeasured, then the one
    # measured to deliver nothing; only the measured relay, the others are leaves.
    assert t.order == ["w1", "w2", "w0", "w3", "w4"]
    # Leaves go where the uplink per child is largest: w1 (9e6 over its relay child and
    # one leaf, then two) before w2 (5e6 / 2) and w0 (1e6 / 1).
    assert parents(t) == {"w1": None, "w2": "w1", "w0": "w2", "w3": "w1", "w4": "w1"}
    t.join(Node("new", "http://new", up_bytes_per_s=1e13))  # declares 10 TB/s: a leaf too
    assert t.placement("new").parent == "w2" and "new" not in parents(t).values()


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_many_leaves_spread_over_the_relays_by_uplink_per_child(mode):
    """Twenty workers whose relays deliver nothing (behind NAT) under two measured relays
    of 8 and 2 MB/s: each leaf goes where it gets the largest share, so the relays end with
    near-equal rates per child, not twenty leaves sharing the slower relay's uplink."""
    t = make(mode, 22)
    for i, node in enumerate(t.order):
        t.nodes[node].delivered_bytes_per_s = {0: 8e6, 1: 2e6}.get(i, 0.0)
    t.rebuild()
    under = [p.parent for n, p in t.placements().items() if n not in ("w0", "w1")]
    children = {"w0": 1 + under.count("w0"), "w1": under.count("w1")}  # w1 is w0's child
    assert sum(children.values()) == 21 and children["w1"] >= 1
    per_child = {r: t.nodes[r].delivered_bytes_per_s / c for r, c in children.items()}
    # Greedy: one more child on either relay would drop its share below the other's.
    assert per_child["w0"] * children["w0"] / (children["w0"] + 1) <= per_child["w1"]
    assert per_child["w1"] * children["w1"] / (children["w1"] + 1) <= per_child["w0"]
    stable = t.placements()
    t.join(Node("late", "http://late"))
    assert {n: p.parent for n, p in t.placements().items() if n != "late"} == {
        n: p.parent for n, p in stable.items()
    }  # a newcomer moves no one until the next rebuild


def test_before_anything_is_measured_every_node_relays_in_join_order():
    t = make("chain", 3, rates=[1e6, 1e13, 5e6])
    t.rebuild()
    t.join(Node("late", "http://late", up_bytes_per_s=1e13))
    assert parents(t) == {"w0": None, "w1": "w0", "w2": "w1", "late": "w2"}


def test_join_attaches_at_a_leaf_and_moves_no_one():
    t = make("tree", 5, fanout=2)
    before = parents(t)
    t.join(Node("new", "http://new", up_bytes_per_s=1e12))  # even the fastest: no reshuffle
    after = parents(t)
    assert {k: after[k] for k in before} == before
    assert "new" not in after.values()  # a leaf: nobody's parent


def test_removed_parent_is_routed_around():
    t = make("chain", 4)
    t.remove("w1")
    assert parents(t) == {"w0": None, "w2": "w0", "w3": "w2"}


def test_excluded_relay_serves_no_one_but_still_receives():
    t = make("chain", 4)
    t.exclude("w1")
    p = parents(t)
    assert "w1" not in {v for k, v in p.items() if k != "w1"}
    assert p["w2"] == "w0" and p["w1"] == "w3"  # hangs under the last healthy node
    t.join(Node("w1", "http://r1"))  # a heartbeat does not bring it back
    assert "w1" not in t.order


def test_bad_config():
    with pytest.raises(ValueError, match="bridge.broadcast"):
        Topology("ring")


def test_auto_reads_a_local_store_directly_and_relays_a_remote_one():
    from bridge.broadcast.topology import resolve_mode

    assert resolve_mode("auto", "file") == resolve_mode("auto", "memory") == "store"
    assert resolve_mode("auto", "s3") == resolve_mode("auto", "gcs") == "chain"
    assert resolve_mode("tree", "file") == "tree" and resolve_mode("store", "s3") == "store"
    with pytest.raises(ValueError, match="bridge.broadcast"):
        resolve_mode("relay", "file")
