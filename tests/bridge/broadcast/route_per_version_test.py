"""Every worker fetches a version on the route the controller gave for that version.

Found in the 30-minute netns soak (issue 47): two learner stalls of 37 s with no fault in
their window. A worker heard of a new version from a submit reply, which carried no route,
and fetched it on the route of the version before; the chain had been re-ranked in
between, so it and its new parent each waited for the other's copy until the 30 s stall
timeout. Three guards, each tested here: every reply that announces a version carries that
version's route (the submit reply too); the order is re-sorted once per version, not again
when a heartbeat that read the older announcement lands after a publish; and a worker
whose route was given for another version reads the store instead of asking a parent.
"""

import http.server
import threading

import numpy as np
import pytest

from bridge.broadcast.state import BroadcastState
from bridge.control.protocol import (
    BroadcastReport,
    Heartbeat,
    HeartbeatResponse,
    LeaseRequest,
    VersionAnnouncement,
)
from bridge.store.weight_store import WeightStore
from rollout_gpu.peer_swap import PeerSwap
from tests.controller_helpers import make, submit_all, worker


def hb(url, report=None):
    return Heartbeat(worker_version=-1, relay_url=url, broadcast=report)


def got(version, peers, fetch_s):
    return BroadcastReport(version=version, fetched_ago_s=0, fetch_s=fetch_s,
                           bytes_from_peers=peers)  # fmt: skip


def test_a_late_heartbeat_of_the_older_version_does_not_re_rank_the_chain():
    s = BroadcastState("chain")
    for w in ("a", "b", "c"):
        s.heartbeat(w, hb(f"http://{w}"), now=0.0)
    s.publish(1, 0.0)
    for w in ("a", "b", "c"):
        s.route(w, 1)  # join order: a <- b <- c
    # Measured on version 1: b delivered 8 MB/s to c, a only 2 MB/s to b.
    s.heartbeat("b", hb("http://b", got(1, 8_000_000, 4.0)), now=1.0)
    s.heartbeat("c", hb("http://c", got(1, 8_000_000, 1.0)), now=1.0)
    s.publish(2, 2.0)
    assert s.route("a", 2)["relay_parent"] == "http://b"  # re-ranked: b <- a
    assert s.route("b", 2)["relay_parent"] is None
    # a measures b at 1 MB/s on version 2: a ranks first again, but only from version 3.
    s.heartbeat("a", hb("http://a", got(2, 8_000_000, 8.0)), now=3.0)
    s.route("c", 1)  # a heartbeat that read version 1's announcement just before the publish
    assert s.route("b", 2)["relay_parent"] is None  # not a <- b: a waits on b for version 2
    assert s.route("a", 2)["relay_parent"] == "http://b"
    s.publish(3, 4.0)
    assert s.route("b", 3)["relay_parent"] == "http://a"
    # A learner rerun republishes a lower number: a publish re-ranks whatever its number.
    s.heartbeat("b", hb("http://b", got(3, 8_000_000, 80.0)), now=5.0)  # a: 0.1 MB/s
    s.publish(2, 6.0)
    assert s.route("b", 2)["relay_parent"] is None


def test_the_submit_reply_carries_the_route_of_the_version_it_announces(tmp_path):
    ctl = make(tmp_path, broadcast="chain")
    a, b = worker(ctl), worker(ctl)
    ctl.heartbeat(a, hb("http://a"))
    ctl.heartbeat(b, hb("http://b"))
    ctl.publish(0)
    lease = ctl.lease(b, LeaseRequest(worker_version=0, max_groups=2)).lease
    ctl.publish(1)  # b first hears of version 1 from its submit reply
    reply = submit_all(ctl, b, lease)
    assert reply.announcement.version == 1
    assert (reply.broadcast_mode, reply.relay_parent) == ("chain", "http://a")
    assert reply.relay_parent == ctl.heartbeat(b, hb("http://b")).relay_parent


class _Parent(http.server.BaseHTTPRequestHandler):
    """A relay that has not begun any version: "not yet" to every read, and it counts them."""

    asked: list = []

    def do_GET(self):  # noqa: N802 - http.server's name
        _Parent.asked.append(self.path)
        self.send_response(503)
        self.send_header("X-Relay-Have", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def parent():
    _Parent.asked = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Parent)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_version_fetched_on_another_versions_route_is_read_from_the_store(tmp_path, parent):
    store = WeightStore(str(tmp_path / "store"))
    w = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)
    store.publish(1, 1, [("w", w)], {}, dtype="float32")
    store.publish(2, 2, [("w", w + 1)], {}, dtype="float32")
    ann = lambda v: VersionAnnouncement(version=v, store=store.spec)  # noqa: E731
    peers = PeerSwap(stall_s=30.0)
    try:
        # The route heard with version 1's announcement; version 1 is fetched through it.
        peers.note_route(HeartbeatResponse(announcement=ann(1), broadcast_mode="chain",
                                           relay_parent=parent))  # fmt: skip
        # Version 2 was never announced with a route: the store, not the parent.
        got_store = peers.store_for(ann(2))
        np.testing.assert_array_equal(got_store.read_all(2)["w"], w + 1)
        assert not [p for p in _Parent.asked if "000000000002" in p]
    finally:
        peers.relay.stop()
