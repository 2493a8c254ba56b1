"""Controller-side broadcast state: routes from heartbeats, bad-parent reports, metrics."""

from bridge.broadcast.state import BroadcastState
from bridge.control.protocol import BroadcastReport, Heartbeat, SourceReport


def hb(url, report=None, up=0.0):
    return Heartbeat(worker_version=-1, relay_url=url, up_bytes_per_s=up, broadcast=report)


def test_routes_follow_the_chain_and_store_mode_adds_nothing():
    s = BroadcastState("chain")
    for i in range(3):
        s.heartbeat(f"w{i}", hb(f"http://r{i}"), now=0.0)
    assert s.route("w0", 1) == {"broadcast_mode": "chain", "relay_parent": None,
                                "relay_fallbacks": []}  # fmt: skip
    assert s.route("w2", 1)["relay_parent"] == "http://r1"
    assert s.route("w2", 1)["relay_fallbacks"] == ["http://r0"]
    assert BroadcastState("store").route("w0", 1) == {}


def test_corrupt_reports_take_a_relay_out_and_dead_ones_skip_it():
    s = BroadcastState("chain", bad_limit=2)
    for i in range(4):  # w3: r2 its parent, r1 its fallback
        s.heartbeat(f"w{i}", hb(f"http://r{i}"), now=0.0)
    s.publish(1, 0.0)
    dead = BroadcastReport(version=1, fetched_ago_s=0, bad_sources=[
        SourceReport(source="http://r1", kind="dead")])  # fmt: skip
    s.heartbeat("w2", hb("http://r2", dead), now=1.0)
    assert s.route("w2", 1)["relay_parent"] == "http://r0"  # suspect until it heartbeats
    s.heartbeat("w1", hb("http://r1"), now=1.5)
    assert s.route("w2", 1)["relay_parent"] == "http://r1"
    for v in (1, 2):  # one report per (reporter, version): twice the same one counts once
        s.publish(v, 0.0)
        assert s.route("w2", v)["relay_parent"] == "http://r1"  # where w2 fetches v from
        bad = BroadcastReport(version=v, fetched_ago_s=0, bad_sources=[
            SourceReport(source="http://r1", kind="corrupt", key="k")])  # fmt: skip
        s.heartbeat("w2", hb("http://r2", bad), now=2.0)
        s.heartbeat("w2", hb("http://r2", bad), now=2.1)
    assert "w1" not in s.topology.excluded  # one reporter alone excludes no one
    assert "http://r1" in s.route("w3", 2)["relay_fallbacks"]
    s.heartbeat("w3", hb("http://r3", bad), now=2.2)  # a second reporter routed to r1
    assert "w1" in s.topology.excluded
    assert s.route("w2", 2)["relay_parent"] == "http://r0"
    assert s.stats(2.2)["broadcast/excluded"] == 1


def test_latency_and_store_bytes_once_every_live_worker_has_the_version():
    s = BroadcastState("chain", worker_timeout_s=30)
    s.publish(2, 50.0)
    s.publish(3, 100.0)
    s.heartbeat("a", hb("http://a", BroadcastReport(version=3, fetched_ago_s=1.0,
                                                    bytes_from_store=1000)), now=105.0)  # fmt: skip
    s.heartbeat("b", hb("http://b", BroadcastReport(version=2, fetched_ago_s=40)), now=105.0)
    s.heartbeat("c", hb("http://c"), now=105.0)  # never reports (no relay): not waited for
    assert "broadcast/latency_s" not in s.stats(106.0)  # b has not got it yet
    s.heartbeat("b", hb("http://b", BroadcastReport(version=3, fetched_ago_s=0.5,
                                                    bytes_from_peers=1000)), now=110.0)  # fmt: skip
    st = s.stats(110.0)
    assert st["broadcast/latency_s"] == 9.5  # b's completion at 109.5, publish at 100
    assert st["broadcast/store_bytes"] == 1000
    # A worker gone silent no longer holds the metric back.
    s.publish(4, 200.0)
    s.heartbeat("a", hb("http://a", BroadcastReport(version=4, fetched_ago_s=0)), now=202.0)
    assert s.stats(220.0)["broadcast/latency_s"] == 2.0  # b silent since 110: gone
