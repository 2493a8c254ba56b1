"""`WeightVersions`, the worker's one owner of its version state, through its transitions:
news (`note`, `reset`, `hear`), a failed load (REFUSED, retried with a doubling backoff on
an injected clock), a relay fetch in flight (FETCHING, from a real PeerSwap whose parent
relay's uplink is throttled, until it lands) and the controller refusing the fetching
claim (`behind`).
No vLLM: loads that must fail fail in the store, before an engine would be touched."""

import time

from bridge.control.protocol import HeartbeatResponse, VersionAnnouncement
from bridge.model import tiny_model
from bridge.store.weight_store import WeightStore
from rollout_gpu.relay import PIECE
from rollout_gpu.versions import VersionState, WeightVersions


def ann(version, store=None, at=0.0):
    return VersionAnnouncement(version=version, store=store, published_at=at)


def test_news_is_ordered_by_publication_time_and_a_registration_resets_it():
    v = WeightVersions()
    assert v.state() is VersionState.NONE and v.loaded == -1 and not v.ensure(None)
    v.note(ann(3, "memory://x", at=10.0))
    v.note(ann(2, "memory://x", at=5.0))  # older news arriving late: ignored
    assert v.announced.version == 3
    v.note(ann(2, "memory://x", at=20.0))  # a rerun republished from its checkpoint
    assert v.announced.version == 2 and v.state() is VersionState.SWAP_READY
    v.reset(ann(1, "memory://x", at=1.0))  # a new controller's word is authoritative
    assert v.announced.version == 1
    v.current.version = 1
    assert v.state() is VersionState.LOADED and v.ensure(None)
    assert v.lease_claims() == dict(worker_version=1, unloadable_version=-1, fetching_version=-1)


def test_a_version_that_fails_to_load_is_refused_then_retried_with_backoff(tmp_path):
    now = [100.0]
    v = WeightVersions(clock=lambda: now[0])
    v.note(ann(3, f"file://{tmp_path}/empty"))  # announced, but the store does not hold it
    assert v.state() is VersionState.SWAP_READY
    assert not v.ensure(None)  # nothing loaded to generate on meanwhile
    assert v.state() is VersionState.REFUSED and v.lease_claims()["unloadable_version"] == 3
    now[0] += 5.1  # the first backoff is 5 s
    assert v.state() is VersionState.SWAP_READY
    assert not v.ensure(None)
    now[0] += 5.1  # then 10 s
    assert v.state() is VersionState.REFUSED
    now[0] += 5.0
    assert v.state() is VersionState.SWAP_READY
    v.current.version = 2  # with a version loaded, a refused newest still leaves work
    v.ensure(None)
    assert v.state() is VersionState.REFUSED and v.ensure(None)


def test_a_relay_fetch_in_flight_is_fetching_until_the_controller_refuses_the_claim(
    tmp_path, relays
):
    from rollout_gpu.peer_swap import PeerSwap

    cfg = tiny_model.tiny_config("qwen3")
    store = WeightStore(f"file://{tmp_path}/store")
    weights = tiny_model.random_hf_weights(cfg, seed=1)
    store.publish(1, 1, weights.items(), model_config=cfg.to_hf_dict(), dtype="float32")
    parent = relays(up_bytes_per_s=30e3, up_burst_bytes=PIECE)  # ~6 s for the tiny model
    parent.fetch(1, [store.spec])
    peers = PeerSwap()
    try:
        v = WeightVersions(peers)
        route = dict(broadcast_mode="chain", relay_parent=parent.url)
        v.hear(HeartbeatResponse(announcement=ann(1, store.spec, at=1.0), **route))
        # Nothing loaded yet: the worker has no version to generate on, so it must swap.
        assert v.state() is VersionState.SWAP_READY
        v.current.version = 0
        assert v.state() is VersionState.FETCHING
        assert v.lease_claims() == dict(worker_version=0, unloadable_version=-1, fetching_version=1)
        assert v.ensure(None)  # keeps generating on version 0 while the relay fetches
        v.behind(claimed_fetching=False)  # a plain "behind" only brought news
        assert v.state() is VersionState.FETCHING
        v.behind(claimed_fetching=True)  # too far behind: wait for the fetch and swap
        assert v.state() is VersionState.SWAP_READY
        v.behind(claimed_fetching=False)
        # The fetch lands: swap-ready on its own. Waited for, also because stopping a relay
        # mid-fetch can outlast Relay.stop's 10 s timeout.
        deadline = time.monotonic() + 60
        while v.state() is VersionState.FETCHING:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert v.state() is VersionState.SWAP_READY and not peers.fetching(1)
    finally:
        peers.close()


def test_a_version_announced_again_is_tried_at_once_and_reported_only_for_its_refused_copy(
    tmp_path,
):
    """The learner publishes an unloadable version again (learner_jax/rl/heal.py): the new
    announcement of the same number ends the refusal and its backoff, and the worker stops
    reporting the version until the new copy fails too (read afresh from the store)."""
    now = [100.0]
    v = WeightVersions(clock=lambda: now[0])
    v.note(ann(2, f"file://{tmp_path}/empty", at=10.0))  # the store does not hold it
    v.current.version = 0
    v.current.bad_versions.add(2)  # as after a failed canary of the first copy
    assert v.ensure(None) and v.state() is VersionState.REFUSED
    assert v.lease_claims()["unloadable_version"] == 2
    v.note(ann(2, f"file://{tmp_path}/empty", at=20.0))  # announced again
    assert v.state() is VersionState.SWAP_READY
    assert v.lease_claims()["unloadable_version"] == -1
    assert v.ensure(None)  # tried at once, read again: still missing here, so refused
    assert 2 not in v.current.bad_versions  # the new copy was not judged by the old canary
    assert v.state() is VersionState.REFUSED and v.lease_claims()["unloadable_version"] == 2
    now[0] += 5.1  # its backoff starts over at 5 s: it is another copy
    assert v.state() is VersionState.SWAP_READY


def test_a_manifest_other_than_the_announced_one_is_refused_before_loading(tmp_path, caplog):
    """The announcement names the manifest's SHA-256; a store holding another manifest under
    that version number is refused before any array is read or the engine touched."""
    import hashlib
    import logging

    import numpy as np

    from bridge.store.layout import LAYOUT

    store = WeightStore(str(tmp_path / "store"))
    store.publish(3, 3, [("a", np.ones((8, 8), np.float32))], {})
    raw = store.kv.read(LAYOUT.manifest_key(3)).result().value
    right = hashlib.sha256(raw).hexdigest()
    v = WeightVersions()
    with caplog.at_level(logging.ERROR):
        v.note(ann(3, store.spec).model_copy(update={"manifest_sha256": "0" * 64}))
        assert not v.ensure(None)
    assert v.state() is VersionState.REFUSED
    assert f"sha256 {right}, not the announced {'0' * 64}" in caplog.text
    assert v.current.version is None and not v.current.tensors
