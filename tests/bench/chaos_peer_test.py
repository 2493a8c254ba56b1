"""The chaos soak's hostile peer (bench/chaos_peer.py, issue 23 class 1), without vLLM.

A real relay with the peer's `flip` serves a published version: a child fetching through it
gets every chunk from the store instead (the altered bytes fail the BLAKE3 digest) and the
controller's re-check proves it corrupt, while an honest relay's same chunk checks ok. The
soak verdict passes a clean run and fails each way an attack could have got through.
"""

import numpy as np
import pytest

from bench import chaos_peer
from bridge.broadcast import chunks as chunks_lib
from bridge.broadcast.report_check import check_chunk
from bridge.store.weight_store import WeightStore
from rollout_gpu.relay import Relay


@pytest.fixture
def relays(tmp_path):
    store = WeightStore(str(tmp_path / "store"))
    rng = np.random.default_rng(0)
    store.publish(1, 1, [("a", rng.standard_normal((64, 32)).astype(np.float32))], {},
                  dtype="float32")  # fmt: skip
    honest, hostile = Relay(), Relay(tamper=chaos_peer.flip)
    try:
        for r in (honest, hostile):
            r.start()
            r.fetch(1, [store.spec], timeout=60)
        yield store, honest, hostile
    finally:
        honest.stop()
        hostile.stop()


def test_the_peers_chunks_are_refused_and_proven_corrupt(relays, tmp_path):
    store, honest, hostile = relays
    key = chunks_lib.chunk_plan(1, store.manifest(1))[0].key
    assert check_chunk(store.spec, hostile.url, 1, key) == "corrupt"
    assert check_chunk(store.spec, honest.url, 1, key) == "ok"  # what the liar accuses

    child = Relay()  # an honest worker's relay, routed to the hostile one first
    try:
        child.start()
        result = child.fetch(1, [hostile.url, store.spec], timeout=60)
        loaded = child.store.read_all(1)["a"]
    finally:
        child.stop()
    assert result.bytes_from_store == result.bytes_total > 0  # nothing from the peer
    assert {r["kind"] for r in result.reports} == {"corrupt"}
    np.testing.assert_array_equal(loaded, store.read_all(1)["a"])


PEER = {"tampered_chunks": 12, "tampering_s": 3.0, "false_reports": 2}
ROW = {"broadcast/corrupt_reports": 2, "broadcast/corrupt_proven": 1,
       "broadcast/false_reports": 2, "broadcast/excluded": 1}  # fmt: skip
SWAP = "I1205 worker.py] now serving version 7 (swap 0.2s, canary ok)\n"


def rows(**over):
    return [{"step": 1, "loss": 0.1}, dict(ROW, step=2, **{"time/wall": 5.0}, **over)]


def test_verdict_passes_a_run_where_the_peer_was_caught():
    v = chaos_peer.verdict(PEER, rows(), [SWAP])
    assert v["ok"], v
    zero = {k: 0 for k in ROW}  # a rerun: the controller's counters start again
    restart = dict(zero, step=3, **{"time/wall": 9.0})
    later = dict(ROW, step=5, **{"time/wall": 12.5})
    assert chaos_peer.exclusions(rows()[1:] + [restart, later]) == [
        {"first_step": 2, "excluded_after_steps": 0, "excluded_after_s": 0.0, "by": "proof"},
        {"first_step": 3, "excluded_after_steps": 2, "excluded_after_s": 3.5, "by": "proof"},
    ]


@pytest.mark.parametrize(
    "peer, metrics, lines",
    [
        (dict(PEER, tampered_chunks=0), rows(), [SWAP]),  # the attack never ran
        (PEER, rows(**{"broadcast/corrupt_proven": 0}), [SWAP]),  # never proven corrupt
        (PEER, rows(**{"broadcast/excluded": 2}), [SWAP]),  # an honest relay out too
        (
            PEER,
            rows(**{"broadcast/corrupt_proven": 0, "broadcast/false_reports": 0})
            + [dict(ROW, step=3)],
            [SWAP],
        ),  # fmt: skip  # excluded before anything proven
        (PEER, rows(), [SWAP, "E1205 could not load version 8: CanaryMismatch: off\n"]),
        (PEER, rows(), []),  # no honest swap at all: nothing was shown
    ],
)
def test_verdict_fails_when_an_attack_got_through(peer, metrics, lines):
    assert not chaos_peer.verdict(peer, metrics, lines)["ok"]
