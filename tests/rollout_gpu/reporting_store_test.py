"""A store-mode worker reads versions through peer_swap's reporting wrapper: a delta version
(rebuilt from its anchor and patches) must read through it exactly as from the store."""

import numpy as np

from bridge.store.weight_store import WeightStore
from bridge.weights.delta_publisher import DeltaPublisher
from bridge.weights.delta_reconstruct import read_version
from rollout_gpu.peer_swap import _ReportingStore


def test_delta_version_reads_through_the_reporting_store(tmp_path):
    store = WeightStore(str(tmp_path / "store"))
    pub = DeltaPublisher(store, anchor_every=4, max_density=0.5)
    rng = np.random.default_rng(0)
    w = {"a": rng.standard_normal((8, 8)).astype(np.float32), "b": np.ones(16, np.float32)}
    pub.publish(0, 0, w.items(), {}, "float32")
    w1 = dict(w, a=w["a"].copy())
    w1["a"][0, :2] += 1.0  # a sparse change: version 1 is a patch on 0
    assert not pub.publish(1, 1, w1.items(), {}, "float32").is_full
    reports = []
    wrapped = _ReportingStore(store, reports.append)
    got = dict(read_version(wrapped, 1))
    for name, want in w1.items():
        np.testing.assert_array_equal(got[name], want)
