"""Swap watcher: one swaps.jsonl line per (worker, version) seen after that version's publish,
and one broadcast.jsonl line per fetch a worker reported."""

from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.protocol import BroadcastReport, Heartbeat, SamplingParams, WorkerProfile
from bridge.tasks import make_task
from learner_jax.rl.swaps import SwapWatcher


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def test_lines_for_swaps_after_a_publish_only(tmp_path):
    clock = Clock()
    ctl = Controller(
        ControllerConfig(staleness=1, groups_per_step=2, group_size=2, vocab_size=100,
                         sampling=SamplingParams(max_tokens=4)),
        str(tmp_path / "ctl.db"),
        make_task("arithmetic"),
        clock,
    )  # fmt: skip
    watcher = SwapWatcher(ctl, str(tmp_path / "swaps.jsonl"), period_s=3600)  # polled by hand
    try:
        watcher.published(ctl.publish(0))  # before any worker: its startup, not a swap
        clock.t = 1001.0
        w, _ = ctl.register(
            WorkerProfile(accelerator="cpu", price_per_hour=0.4, max_concurrent_sequences=8)
        )
        ctl.heartbeat(w, Heartbeat(worker_version=0))
        assert watcher.poll(clock()) == []
        clock.t = 1002.0
        watcher.published(ctl.publish(1))
        clock.t = 1003.5
        ctl.heartbeat(w, Heartbeat(worker_version=1))
        lines = watcher.poll(clock())
        assert lines == [
            {
                "worker_id": w,
                "price_per_hour": 0.4,
                "version": 1,
                "seen_at": 1003.5,
                "published_at": 1002.0,
            }
        ]
        assert watcher.poll(clock()) == []  # reported once
    finally:
        watcher.stop()
        ctl.close()


def test_broadcast_lines_from_the_workers_fetch_reports(tmp_path):
    clock = Clock()
    ctl = Controller(
        ControllerConfig(staleness=1, groups_per_step=2, group_size=2, vocab_size=100,
                         sampling=SamplingParams(max_tokens=4), broadcast="chain"),
        str(tmp_path / "ctl.db"),
        make_task("arithmetic"),
        clock,
    )  # fmt: skip
    watcher = SwapWatcher(ctl, str(tmp_path / "swaps.jsonl"), period_s=3600)
    try:
        w, _ = ctl.register(
            WorkerProfile(accelerator="cpu", price_per_hour=0.4, max_concurrent_sequences=8)
        )
        ctl.publish(3)
        clock.t = 1004.0  # the worker finished its fetch 0.5 s before this heartbeat
        report = BroadcastReport(version=3, fetched_ago_s=0.5, fetch_s=2.0,
                                 bytes_from_store=4096, bytes_from_peers=10**6)  # fmt: skip
        ctl.heartbeat(w, Heartbeat(worker_version=3, relay_url="http://127.0.0.1:9/",
                                   broadcast=report))  # fmt: skip
        lines = watcher.poll_fetches()
        assert lines == [
            {
                "worker_id": w,
                "version": 3,
                "published_at": 1000.0,
                "done_at": 1003.5,
                "bytes_from_store": 4096,
                "bytes_from_peers": 10**6,
                "latency_s": 3.5,
            }
        ]
        ctl.heartbeat(w, Heartbeat(worker_version=3, broadcast=report))
        assert watcher.poll_fetches() == []  # one line per (worker, version)
        assert watcher.broadcast_path == str(tmp_path / "broadcast.jsonl")
    finally:
        watcher.stop()
        ctl.close()
