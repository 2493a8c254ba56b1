"""Standalone weight relays as processes, for the broadcast bench and the relay fault tests
(no absl flags here: a test may import it beside modules that define their own).

    procs, urls = start_relays(n, up_mbps, tmp)     # `python -m rollout_gpu.relay` each
    sha = manifest_sha(store_or_relay_url, v)       # what a controller would announce
    call(url, "/fetch", {"version": v, "sources": [...], "manifest_sha256": sha})
    wait_complete(url, v)                           # seconds until it holds v, verified
    start_relays_in(bed, hosts, tmp)                # one per bench/netbed.py host, in its netns
    publish_model(store, model_bytes, chunk_bytes, version)   # random bf16 "linears"
    publish_delta_chain(store, model_bytes, chunk_bytes, first, k, density)  # anchor + k deltas
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np

from bridge.store import chunk_digest
from bridge.store.layout import LAYOUT
from bridge.store.weight_store import WeightStore


def manifest_sha(source: WeightStore | str, version: int) -> str:
    """SHA-256 of `version`'s manifest in a store or as a relay URL serves it (the harness's
    own origin): the hash a controller announces and a relay's POST /fetch must name."""
    key = LAYOUT.manifest_key(version)
    if isinstance(source, WeightStore):
        raw = source.kv.read(key).result().value
    else:
        with urllib.request.urlopen(f"{source}/kv/{key}", timeout=30) as r:
            raw = r.read()
    return hashlib.sha256(raw).hexdigest()


def call(url: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST" if data else "GET")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def wait_complete(url: str, version: int, timeout: float = 900.0) -> float:
    """Seconds until the relay at `url` holds `version`, every chunk verified."""
    t0 = time.time()
    while True:
        v = call(url, "/status")["versions"].get(str(version), {})
        if v.get("failed"):
            raise RuntimeError(f"{url}: version {version}: {v['failed']}")
        if v.get("complete"):
            return time.time() - t0
        if time.time() - t0 > timeout:
            raise RuntimeError(f"{url}: version {version} not complete in {timeout:.0f} s")
        time.sleep(0.05)


def start_relays(
    n: int, up_mbps: float, tmp: str, prefix: str = "relay", burst_kb: int | None = None
) -> tuple[list, list[str]]:
    procs, files = [], []
    for i in range(n):
        f = os.path.join(tmp, f"{prefix}{i}.url")
        cmd = [sys.executable, "-m", "rollout_gpu.relay", f"--up_mbps={up_mbps}", f"--url_file={f}"]
        cmd += [f"--up_burst_kb={burst_kb}"] if burst_kb else []
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
        files.append(f)
    return procs, _urls(procs, files)


def start_relays_in(bed, hosts: list[str], tmp: str) -> tuple[list, list[str]]:
    """One relay per testbed host (bench/netbed.py), inside its network namespace, bound
    to its address, with no upload limit of its own: the kernel shapes its link."""
    procs, files = [], []
    for host in hosts:
        f = os.path.join(tmp, f"{host}.url")
        cmd = [sys.executable, "-m", "rollout_gpu.relay", f"--host={bed.ip(host)}",
               f"--url_file={f}"]  # fmt: skip
        procs.append(bed.popen(host, cmd, stdout=subprocess.DEVNULL))
        files.append(f)
    return procs, _urls(procs, files)


def _urls(procs: list, files: list[str]) -> list[str]:
    deadline = time.time() + 120
    while not all(os.path.exists(f) for f in files):
        if time.time() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError("relays did not start")
        time.sleep(0.2)
    return [open(f).read().strip() for f in files]


def random_linears(model_bytes: int, rng) -> list[tuple[str, np.ndarray]]:
    """~`model_bytes` of random [rows, 1024] matrices of ~8 MB in bf16, like a small model's
    linears (float32 here: the store converts)."""
    cols, left, arrays, i = 1024, model_bytes, [], 0
    while left > 0:
        rows = max(1, min(4096, left // (2 * cols)))
        arrays.append((f"w{i}", rng.standard_normal((rows, cols), dtype=np.float32)))
        left, i = left - rows * cols * 2, i + 1
    return arrays


def publish_model(store: WeightStore, model_bytes: int, chunk_bytes: int, version: int) -> int:
    """Publish ~`model_bytes` of random bf16 [rows, 1024] matrices in `chunk_bytes` chunks;
    returns the version's stored bytes."""
    arrays = random_linears(model_bytes, np.random.default_rng(0))
    default = chunk_digest.CHUNK_BYTES
    chunk_digest.CHUNK_BYTES = chunk_bytes  # the chunk grid is chosen at publish time
    try:
        return store.publish(version, 0, arrays, {}, dtype="bfloat16").total_bytes
    finally:  # a test process goes on publishing with the store's default
        chunk_digest.CHUNK_BYTES = default


def publish_delta_chain(
    store: WeightStore,
    model_bytes: int,
    chunk_bytes: int,
    first: int,
    k: int,
    density: float,
    piece_bytes: int | None = None,
) -> list:
    """Publish version `first` (full) and `k` delta versions after it (bridge/weights/), each
    replacing a random `density` of the bf16 elements (an RL step's changed fraction at a
    small learning rate: bench.delta measures 1-4% at lr 1e-6); returns the manifests.
    `piece_bytes`: patch pieces of this size (default: the chunk size; larger than any
    patch = one object per patch, as before patches were split)."""
    import ml_dtypes

    from bridge.weights import delta_publisher as publisher
    from bridge.weights.delta_publisher import DeltaPublisher

    rng = np.random.default_rng(1)
    arrays = [(n, a.astype(ml_dtypes.bfloat16)) for n, a in random_linears(model_bytes, rng)]
    pub = DeltaPublisher(store, anchor_every=k + 1, max_density=0.5)
    default = chunk_digest.CHUNK_BYTES
    chunk_digest.CHUNK_BYTES, publisher.PIECE_BYTES = chunk_bytes, piece_bytes
    try:
        out = [pub.publish(first, 0, arrays, {}, "bfloat16")]
        for v in range(first + 1, first + k + 1):
            arrays = [(n, a.copy()) for n, a in arrays]
            for _, a in arrays:
                mask = rng.random(a.shape) < density
                a[mask] = rng.standard_normal(int(mask.sum())).astype(ml_dtypes.bfloat16)
            out.append(pub.publish(v, v - first, arrays, {}, "bfloat16"))
        return out
    finally:
        chunk_digest.CHUNK_BYTES, publisher.PIECE_BYTES = default, None
