"""kill -9 of the middle relay process of a chain, mid-broadcast: every other receiver still
completes with verified bytes, routed around the dead relay rather than restarted from the
origin: the origin serves about one copy, not one per survivor (real relay processes,
`python -m rollout_gpu.relay`, throttled links; no vLLM). Bytes, not a wall-clock ratio
to a fault-free run, are what is compared: a loaded machine stretches both runs unevenly."""

import os
import signal
import time

import numpy as np
import pytest
import tensorstore as ts

from bench import relay_procs as bench
from bridge.store.layout import LAYOUT
from bridge.store.weight_store import WeightStore
from rollout_gpu.peer_fetch import sources_for

pytestmark = pytest.mark.slow  # ~30 s: four relay processes, two timed broadcasts

MB_PER_S = 4.0  # every link; the version is 8 MB: 2 s per copy


def _status(url: str, version: int) -> dict:
    return bench.call(url, "/status")["versions"].get(str(version), {})


def _broadcast(origin, relays, version, kill=None):
    """Chain origin -> relays[0] -> relays[1] -> ...; each relay's fallbacks are its
    grandparent, then the origin. `kill` = (index, process): kill -9 it once the relay
    after it holds a few chunks. Returns (seconds until the last live relay completed,
    status of each relay)."""
    urls = [u for _, u in relays]
    for u in urls:
        bench.call(u, "/forget", {"version": version})
    sha = bench.manifest_sha(origin, version)
    t0 = time.time()
    for i, u in enumerate(urls):
        up = [origin, *urls[:i]][::-1]
        srcs = sources_for(up[0], up[1:2], origin) if i else [origin]
        bench.call(u, "/fetch", {"version": version, "sources": srcs, "manifest_sha256": sha})
    killed = None
    while True:
        if kill and killed is None and _status(urls[kill[0] + 1], version).get("have", 0) >= 3:
            os.kill(kill[1].pid, signal.SIGKILL)
            kill[1].wait(timeout=10)
            killed = kill[0]
        live = [u for i, u in enumerate(urls) if i != killed]
        states = [_status(u, version) for u in live]
        assert not any(s.get("failed") for s in states), states
        if all(s.get("complete") for s in states):
            return max(s["completed_at"] for s in states) - t0, dict(zip(live, states, strict=True))
        assert time.time() - t0 < 120, states
        time.sleep(0.05)


def test_kill_9_of_the_middle_relay_mid_broadcast(tmp_path):
    store = WeightStore(str(tmp_path / "store"))
    m1 = bench.publish_model(store, 8 * 10**6, 256 << 10, 1)
    bench.publish_model(store, 8 * 10**6, 256 << 10, 2)
    procs, urls = bench.start_relays(4, MB_PER_S, str(tmp_path))
    try:
        origin, relays = urls[0], list(zip(procs[1:], urls[1:], strict=True))
        for v in (1, 2):  # the origin (the store's uplink) holds both versions
            sha = bench.manifest_sha(store, v)
            bench.call(origin, "/fetch", {"version": v, "sources": [store.spec],
                                          "manifest_sha256": sha})  # fmt: skip
            while not _status(origin, v).get("complete"):
                time.sleep(0.05)
        clean_s, _ = _broadcast(origin, relays, 1)
        assert clean_s < 3 * m1 / (MB_PER_S * 1e6), clean_s  # pipelined, not 3 copies
        origin_up = bench.call(origin, "/status")["bytes_up"]
        _, states = _broadcast(origin, relays, 2, kill=(0, procs[1]))
        assert set(states) == {urls[2], urls[3]}  # both receivers after the killed relay
        # The killed relay's share (a few chunks ahead of its child) plus the rest once to its
        # child: about one copy. Restarting every survivor from the origin would be two.
        origin_up = bench.call(origin, "/status")["bytes_up"] - origin_up
        assert origin_up < 1.5 * m1, (origin_up, m1)
        # What the survivors serve is the store's bytes: read one array back through each
        # survivor as tensorstore's own http kvstore and compare with the store.
        want = store.read_all(2)
        for u in states:
            name = sorted(want)[0]
            spec = {"driver": "http", "base_url": u + "/kv/", "path": LAYOUT.array_prefix(2, name)}
            got = ts.open({"driver": "zarr3", "kvstore": spec}, open=True).result().read().result()
            assert np.array_equal(got.view(np.uint16), want[name].view(np.uint16)), u
        # The receiver whose parent died reported it and took over from its grandparent.
        reports = bench.call(urls[2], "/status")["results"]["2"]["reports"]
        assert any(r["kind"] == "dead" and r["source"] == urls[1] for r in reports), reports
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
