"""Topology from measured delivery (issue 23 item 2), fed by the heartbeats workers send
(protocol.Heartbeat with its BroadcastReport, as the controller's /v1/heartbeat passes
them on): a worker declaring a huge uplink is placed by what its children measured once
they have, a corrupt-chunk report counts only for a published version and a relay the
reporter was routed to, and one reporter alone excludes no relay."""

from bridge.broadcast.state import BroadcastState
from bridge.control.protocol import BroadcastReport, Heartbeat, SourceReport


def hb(url, up=0.0, report=None):
    return Heartbeat(worker_version=-1, relay_url=url, up_bytes_per_s=up, broadcast=report)


def got(version, peers, fetch_s, bad=()):
    return BroadcastReport(
        version=version,
        fetched_ago_s=0,
        fetch_s=fetch_s,
        bytes_from_peers=peers,
        bad_sources=[SourceReport(source=u, kind="corrupt", key="k") for u in bad],
    )


def test_a_declared_uplink_places_no_one():
    s = BroadcastState("chain")
    s.heartbeat("honest", hb("http://h", up=5e6), now=0.0)
    s.heartbeat("liar", hb("http://l", up=1e13), now=0.0)  # declares 10 TB/s
    s.heartbeat("leaf", hb("http://f", up=1e6), now=0.0)
    s.publish(1, 0.0)
    # Nothing measured yet: join order; the declarations place no one.
    assert s.route("honest", 1)["relay_parent"] is None
    assert s.route("liar", 1)["relay_parent"] == "http://h"
    assert s.route("leaf", 1)["relay_parent"] == "http://l"
    # The liar's child got nothing from peers in 4 s (it fell back to the store); the liar
    # got 8 MB from the honest relay in 2 s.
    s.heartbeat("liar", hb("http://l", up=1e13, report=got(1, 8_000_000, 2.0)), now=5.0)
    s.heartbeat("leaf", hb("http://f", up=1e6, report=got(1, 0, 4.0)), now=5.0)
    assert s.topology.nodes["liar"].delivered_bytes_per_s == 0.0
    assert s.topology.nodes["honest"].delivered_bytes_per_s == 4e6
    s.publish(2, 10.0)  # re-ranked: measured first, unmeasured next, nothing-delivered last
    assert s.route("honest", 2)["relay_parent"] is None
    assert s.topology.order == ["honest", "leaf", "liar"]
    # A newcomer declaring 10 TB/s lands behind every relay that has delivered.
    s.heartbeat("liar2", hb("http://l2", up=1e13), now=11.0)
    s.publish(3, 12.0)
    s.route("honest", 3)
    assert s.topology.order == ["honest", "leaf", "liar2", "liar"]


def test_corrupt_reports_count_only_for_a_route_taken_and_a_published_version():
    s = BroadcastState("chain", bad_limit=2)
    for w in ("a", "b", "c", "d", "e"):  # chain a <- b <- c <- d <- e
        s.heartbeat(w, hb(f"http://{w}"), now=0.0)
    s.publish(1, 0.0)
    assert s.route("c", 1)["relay_parent"] == "http://b"
    # d was never routed to e (its child) for version 1; version 7 was never published.
    assert s.route("d", 1) == {"broadcast_mode": "chain", "relay_parent": "http://c",
                               "relay_fallbacks": ["http://b", "http://a"]}  # fmt: skip
    # (Each reporter got a little from peers: a relay measured to deliver nothing would
    # move to the chain's end, which is not what this test is about.)
    s.heartbeat("d", hb("http://d", report=got(1, 1000, 1.0, bad=["http://e"])), now=1.0)
    s.heartbeat("c", hb("http://c", report=got(7, 0, 1.0, bad=["http://b"])), now=1.0)
    assert s.stats(1.0)["broadcast/corrupt_reports"] == 0
    # c was routed to b: its report counts, but one reporter alone excludes no one, even
    # over several versions.
    for v in (1, 2):
        s.publish(v, 0.0)
        s.route("c", v)
        s.heartbeat("c", hb("http://c", report=got(v, 1000, 1.0, bad=["http://b"])), now=2.0)
    assert s.stats(2.0)["broadcast/corrupt_reports"] == 2 and not s.topology.excluded
    # A second reporter that fetched from b (its fallback) makes two: b relays no more.
    assert "http://b" in s.route("d", 2)["relay_fallbacks"]
    s.heartbeat("d", hb("http://d", report=got(2, 1000, 1.0, bad=["http://b"])), now=3.0)
    assert s.topology.excluded == {"b"}


def test_a_delta_versions_small_payload_does_not_rerank_relays_measured_on_an_anchor():
    """A 2% delta fetch is latency-bound: its bytes / seconds is far below the uplink. The
    rates measured on the anchor (8 MB) stay until a payload of the same order, a higher
    rate, or a parent that delivered nothing says otherwise."""
    s = BroadcastState("chain")
    for w in ("a", "b", "c", "d"):  # chain a <- b <- c <- d
        s.heartbeat(w, hb(f"http://{w}"), now=0.0)
    s.publish(1, 0.0)  # an anchor: b measured a at 4 MB/s, d measured c at 2 MB/s
    for w in ("b", "c", "d"):
        s.route(w, 1)
    s.heartbeat("b", hb("http://b", report=got(1, 8_000_000, 2.0)), now=1.0)
    s.heartbeat("d", hb("http://d", report=got(1, 8_000_000, 4.0)), now=1.0)
    s.publish(2, 2.0)  # a delta: b reports it (160 kB in 0.5 s), d not yet
    for w in ("b", "c", "d"):
        s.route(w, 2)
    s.heartbeat("b", hb("http://b", report=got(2, 160_000, 0.5)), now=3.0)
    assert s.topology.nodes["a"].delivered_bytes_per_s == 4e6  # not 0.32 MB/s
    s.publish(3, 4.0)  # re-ranked: a still ahead of c
    assert s.topology.order.index("a") < s.topology.order.index("c")
    # In a chain a <- b: a higher rate on a delta, a parent that delivered nothing, and a
    # payload of the same order do count.
    s = BroadcastState("chain")
    s.heartbeat("a", hb("http://a"), now=0.0)
    s.heartbeat("b", hb("http://b"), now=0.0)
    for v, peers, seconds, want in [
        (1, 8_000_000, 2.0, 4e6),  # the anchor
        (2, 160_000, 0.5, 4e6),  # a delta, latency-bound: kept
        (3, 160_000, 0.02, 8e6),  # a delta faster than the anchor's rate
        (4, 8_000_000, 4.0, 2e6),  # the next anchor
        (5, 160_000, 4.0, 2e6),
        (6, 0, 0.5, 0.0),  # nothing from peers
    ]:
        s.publish(v, float(v))
        assert s.route("b", v)["relay_parent"] == "http://a"
        s.heartbeat("b", hb("http://b", report=got(v, peers, seconds)), now=v + 0.5)
        assert s.topology.nodes["a"].delivered_bytes_per_s == want, v
    s.publish(7, 7.0)  # a relay measured to deliver nothing now hangs below b
    assert s.route("b", 7)["relay_parent"] is None
    assert s.route("a", 7)["relay_parent"] == "http://b"
