"""Standalone weight relays as processes, for the broadcast bench and the relay fault tests
(no absl flags here: a test may import it beside modules that define their own).

    procs, urls = start_relays(n, up_mbps, tmp)     # `python -m rollout_gpu.relay` each
    call(url, "/fetch", {"version": v, "sources": [...]})
    publish_model(store, model_bytes, chunk_bytes, version)   # random bf16 "linears"
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request

import numpy as np

from bridge.store import chunk_digest
from bridge.store.weight_store import WeightStore


def call(url: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST" if data else "GET")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def start_relays(n: int, up_mbps: float, tmp: str, prefix: str = "relay") -> tuple[list, list[str]]:
    procs, files = [], []
    for i in range(n):
        f = os.path.join(tmp, f"{prefix}{i}.url")
        cmd = [sys.executable, "-m", "rollout_gpu.relay", f"--up_mbps={up_mbps}", f"--url_file={f}"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
        files.append(f)
    deadline = time.time() + 120
    while not all(os.path.exists(f) for f in files):
        if time.time() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError("relays did not start")
        time.sleep(0.2)
    return procs, [open(f).read().strip() for f in files]


def publish_model(store: WeightStore, model_bytes: int, chunk_bytes: int, version: int) -> int:
    """Publish ~`model_bytes` of random bf16 [rows, 1024] matrices in `chunk_bytes` chunks;
    returns the version's stored bytes."""
    rng = np.random.default_rng(0)
    cols, left, arrays, i = 1024, model_bytes, [], 0
    while left > 0:  # [rows, 1024] bf16 matrices of ~8 MB, like a small model's linears
        rows = max(1, min(4096, left // (2 * cols)))
        arrays.append((f"w{i}", rng.standard_normal((rows, cols), dtype=np.float32)))
        left, i = left - rows * cols * 2, i + 1
    default = chunk_digest.CHUNK_BYTES
    chunk_digest.CHUNK_BYTES = chunk_bytes  # the chunk grid is chosen at publish time
    try:
        return store.publish(version, 0, arrays, {}, dtype="bfloat16").total_bytes
    finally:  # a test process goes on publishing with the store's default
        chunk_digest.CHUNK_BYTES = default
