"""A peer URL is never treated as a weight store (issue 23 item 4, worker side): the
controller's route may name only http(s) relays; a `file://`, object-store or bare-path
"peer" is dropped before `Source.parse` could read it as a store, so a hostile route cannot
point a worker at weights outside the announced store."""

from rollout_gpu.peer_fetch import Source, sources_for


def test_a_non_http_peer_is_dropped_not_read_as_a_store(tmp_path):
    store = {"root": str(tmp_path / "store")}
    hostile = ["file:///tmp/evil", "s3://attacker/run", "/tmp/evil", "gs://x/y"]
    got = sources_for(hostile[0], [*hostile[1:], "http://10.0.0.7:8001/"], store)
    assert got == ["http://10.0.0.7:8001/", store]
    kinds = [Source.parse(s).kind for s in got]
    assert kinds == ["relay", "store"]  # exactly one store: the announced one
    assert sources_for("https://peer:1", [], store) == ["https://peer:1", store]
    assert sources_for(None, [], store) == [store]
