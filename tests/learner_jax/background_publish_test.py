"""BackgroundPublisher: in order, latest wins while busy, errors reach the learner's thread."""

import threading

import pytest

from learner_jax.background_publish import BackgroundPublisher, PublishError


class Recorder:
    """A publish function that records versions and can be held mid-publish."""

    def __init__(self, fail_on=None):
        self.done, self.fail_on = [], fail_on
        self.started, self.release = threading.Event(), threading.Event()
        self.release.set()

    def __call__(self, version, params):
        self.started.set()
        assert self.release.wait(10)
        if version == self.fail_on:
            raise OSError(f"store unreachable at version {version}")
        self.done.append((version, params))


def test_versions_go_out_in_order_and_flush_waits():
    rec = Recorder()
    pub = BackgroundPublisher(rec)
    for v in range(5):
        pub.submit(v, {"w": v})
        assert pub.flush(10)
    assert rec.done == [(v, {"w": v}) for v in range(5)]
    assert pub.last_version == 4 and pub.skipped == 0 and pub.last_s >= 0
    pub.close(10)
    with pytest.raises(PublishError, match="closed"):
        pub.submit(5, {})


def test_a_newer_version_replaces_one_still_waiting():
    rec = Recorder()
    rec.release.clear()
    pub = BackgroundPublisher(rec)
    pub.submit(1, "p1")
    assert rec.started.wait(10)  # 1 is being written (held)
    pub.submit(2, "p2")  # waits behind 1 ...
    pub.submit(3, "p3")  # ... and is replaced by 3
    assert not pub.flush(0.05)  # still busy
    rec.release.set()
    assert pub.flush(10)
    assert [v for v, _ in rec.done] == [1, 3] and pub.skipped == 1
    pub.close(10)


def test_a_failed_publish_surfaces_on_the_next_submit_and_on_flush():
    pub = BackgroundPublisher(Recorder(fail_on=2))
    pub.submit(1, None)
    assert pub.flush(10)
    pub.submit(2, None)
    with pytest.raises(PublishError, match="OSError: store unreachable at version 2"):
        pub.flush(10)
    with pytest.raises(PublishError, match="unreachable"):
        pub.submit(3, None)
    with pytest.raises(PublishError):
        pub.close(10)
    assert pub.last_version == 1
