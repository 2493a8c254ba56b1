"""Broadcast benchmark: one weight version from the store to N relays, store vs chain vs tree.

    python -m bench.broadcast --out=/tmp/bench_broadcast.json [--model_mb=32] [--up_mbps=16]
        [--chunk_kb=1024] [--n=1,2,4,8,16] [--modes=store,chain,tree] [--fanout=2] [--repeats=3]

N standalone relays (`python -m rollout_gpu.relay`, separate processes, real HTTP on
loopback, no vLLM) each with an upload token bucket of B = --up_mbps; the store's uplink
is modelled the same way: an origin relay throttled at B that holds the version (it read
it from a local file store before timing starts). A model of M = --model_mb random bf16
weights in chunks of c = --chunk_kb is published with WeightStore. The default M is small
(32 MB, not Qwen3-0.6B's 1.2 GB) and B low, so the 16-relay runs fit a 2-core machine in a
few minutes: what Python moves per second across all relays (N * B in a chain) is the
limit here, not the modelled links. Per (N, mode): the median over --repeats of
  time_s        from the fetch orders to the last relay having verified every chunk
  origin_MB     bytes the origin (the store's uplink) served, and copies = that / M
against the ideals: one-to-many N*M/B, chain (M + (N-1)c)/B, tree (fM + depth*c)/B
(PAPER.md, our derivation) and the Kumar & Ross lower bound max(M/u_s, N*M/(u_s + sum u_i))
(downlinks unthrottled). ratio = time_s / Kumar-Ross.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np
from absl import app, flags

from bridge.broadcast import topology as topo
from bridge.store import chunk_digest
from bridge.store.weight_store import WeightStore
from rollout_gpu.peer_fetch import sources_for

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "JSON file for the results.", required=True)
flags.DEFINE_integer("model_mb", 32, "Model size M in MB (bf16 random weights).")
flags.DEFINE_integer("chunk_kb", 1024, "Chunk size c in KiB (the store's default is 4096).")
flags.DEFINE_float("up_mbps", 16.0, "Upload limit B of every relay and of the origin, MB/s.")
flags.DEFINE_list("n", ["1", "2", "4", "8", "16"], "Relay counts N.")
flags.DEFINE_list("modes", ["store", "chain", "tree"], "Topologies.")
flags.DEFINE_integer("fanout", 2, "Tree fan-out f.")
flags.DEFINE_integer("repeats", 3, "Repeats per (N, mode); medians are reported.")
VERSION = 1


def _call(url: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST" if data else "GET")
    req.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _start_relays(n: int, up_mbps: float, tmp: str) -> tuple[list, list[str]]:
    procs, files = [], []
    for i in range(n):
        f = os.path.join(tmp, f"relay{i}.url")
        cmd = [sys.executable, "-m", "rollout_gpu.relay", f"--up_mbps={up_mbps}", f"--url_file={f}"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL))
        files.append(f)
    deadline = time.time() + 120
    while not all(os.path.exists(f) for f in files):
        if time.time() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError("relays did not start")
        time.sleep(0.2)
    return procs, [open(f).read().strip() for f in files]


def _publish(store: WeightStore, model_bytes: int, chunk_bytes: int) -> int:
    chunk_digest.CHUNK_BYTES = chunk_bytes  # the chunk grid is chosen at publish time
    rng = np.random.default_rng(0)
    cols, left, arrays, i = 1024, model_bytes, [], 0
    while left > 0:  # [rows, 1024] bf16 matrices of ~8 MB, like a small model's linears
        rows = max(1, min(4096, left // (2 * cols)))
        arrays.append((f"w{i}", rng.standard_normal((rows, cols), dtype=np.float32)))
        left, i = left - rows * cols * 2, i + 1
    return store.publish(VERSION, 0, arrays, {}, dtype="bfloat16").total_bytes


def _run(origin: str, relays: list[str], mode: str, fanout: int) -> dict:
    t = topo.Topology(mode, fanout)
    for i, url in enumerate(relays):
        t.join(topo.Node(f"r{i}", url))
    for url in relays:
        _call(url, "/forget", {"version": VERSION})
    before = _call(origin, "/status")["bytes_up"]
    t0 = time.time()
    depth = 1
    for i, url in enumerate(relays):
        p = t.placement(f"r{i}")
        depth = max(depth, p.depth)
        srcs = sources_for(p.parent_url, p.fallback_urls, origin)
        _call(url, "/fetch", {"version": VERSION, "sources": srcs})
    done: dict[str, float] = {}
    while len(done) < len(relays):
        time.sleep(0.05)
        for url in relays:
            v = _call(url, "/status")["versions"].get(str(VERSION))
            if v and v["failed"]:
                raise RuntimeError(f"{url}: {v['failed']}")
            if v and v["complete"]:
                done[url] = v["completed_at"]
        if time.time() - t0 > 900:
            raise RuntimeError("broadcast did not finish in 15 min")
    origin_bytes = _call(origin, "/status")["bytes_up"] - before
    return {"time_s": max(done.values()) - t0, "origin_bytes": origin_bytes, "depth": depth}


def ideals(mode: str, n: int, m: float, c: float, b: float, f: int, depth: int) -> dict:
    one_to_many = n * m / b
    kumar_ross = max(m / b, n * m / (b + n * b))
    model = {
        "store": one_to_many,
        "chain": (m + (n - 1) * c) / b,
        "tree": (m if n == 1 else min(f, n - 1) * m + (depth - 1) * c) / b,
    }[mode]
    return {"model_s": model, "kumar_ross_s": kumar_ross, "one_to_many_s": one_to_many}


def main(argv):
    del argv
    tmp = tempfile.mkdtemp(prefix="bench_broadcast_")
    procs = []
    try:
        store = WeightStore(os.path.join(tmp, "store"))
        m = _publish(store, FLAGS.model_mb * 10**6, FLAGS.chunk_kb << 10)
        c, b = float(FLAGS.chunk_kb << 10), FLAGS.up_mbps * 1e6
        ns = sorted(int(x) for x in FLAGS.n)
        procs, urls = _start_relays(ns[-1] + 1, FLAGS.up_mbps, tmp)
        origin, relays = urls[0], urls[1:]
        _call(origin, "/fetch", {"version": VERSION, "sources": [store.spec]})
        while not _call(origin, "/status")["versions"].get(str(VERSION), {}).get("complete"):
            time.sleep(0.1)
        rows = []
        print(f"M={m / 1e6:.1f} MB  c={c / 2**10:.0f} KiB  B={b / 1e6:.1f} MB/s  f={FLAGS.fanout}")
        hdr = f"{'N':>3} {'mode':>6} {'time_s':>8} {'model_s':>8} {'KR_s':>7} {'ratio':>6} "
        print(hdr + f"{'1toN_s':>8} {'origin_MB':>10} {'copies':>7}")
        for n in ns:
            for mode in FLAGS.modes:
                runs = [_run(origin, relays[:n], mode, FLAGS.fanout) for _ in range(FLAGS.repeats)]
                t = statistics.median(r["time_s"] for r in runs)
                ob = statistics.median(r["origin_bytes"] for r in runs)
                ide = ideals(mode, n, m, c, b, FLAGS.fanout, runs[0]["depth"])
                row = {"n": n, "mode": mode, "time_s": t, "origin_bytes": ob, "copies": ob / m}
                row |= ide | {"ratio_kr": t / ide["kumar_ross_s"], "runs": runs}
                rows.append(row)
                print(
                    f"{n:>3} {mode:>6} {t:>8.2f} {ide['model_s']:>8.2f} "
                    f"{ide['kumar_ross_s']:>7.2f} {row['ratio_kr']:>6.2f} "
                    f"{ide['one_to_many_s']:>8.2f} {ob / 1e6:>10.1f} {ob / m:>7.2f}",
                    flush=True,
                )
        out = {
            "model_bytes": m,
            "chunk_bytes": c,
            "up_bytes_per_s": b,
            "fanout": FLAGS.fanout,
            "repeats": FLAGS.repeats,
            "cpu_count": os.cpu_count(),
            "rows": rows,
        }
        with open(FLAGS.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {FLAGS.out}")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    app.run(main)
