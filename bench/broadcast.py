"""Broadcast benchmark: one weight version from the store to N relays, store vs chain vs tree.

    python -m bench.broadcast --out=/tmp/bench_broadcast.json [--model_mb=40] [--up_mbps=8]
        [--chunk_kb=1024] [--n=1,2,4,8,16] [--modes=store,chain,tree] [--fanout=2]
        [--repeats=3] [--sweep_chunk_kb=256,1024,4096] [--sweep_n=8]
        [--delta_versions=3] [--delta_n=8] [--delta_density=0.02] [--delta_patches=pieces,whole]

N standalone relays (`python -m rollout_gpu.relay`, separate processes, real HTTP on
loopback, no vLLM) each with an upload token bucket of B = --up_mbps; the store is modelled
as an origin relay throttled at its own bandwidth s = --store_mbps (what the store serves in
all, to every reader together) that holds the version (it read it from a local file store
before timing starts). s is a separate parameter (issue 30): a cloud object store usually
serves far more than one peer's uplink, and the store arm (every worker reads the store) is
only an honest baseline when it gets the store's bandwidth, not a peer's. `--store_mbps=0`
(the default) measures it: the local file store's own read throughput for the version
(WeightStore.read_all, digests verified); `s` is printed and written with the rows. Give
the store's real figure (what one bucket serves a region) with --store_mbps to plan a real
fleet. A model of M = --model_mb random bf16 weights in chunks of c = --chunk_kb is
published with WeightStore. M/B is 5 s by default
(40 MB at 8 MB/s, not Qwen3-0.6B's 1.2 GB): what Python moves per second across all relays
(N * B in a chain) must stay below what two cores can move, or the CPU and not the
modelled links is the bottleneck; `link_MBps` (each receiver's bytes / its own fetch time,
median and min over receivers) shows whether the links ran at B. Per (arm, N), medians
over --repeats:
  seconds       from the fetch orders to the last relay having verified every chunk
  ideal_s       M / B (one copy over one link)
  ratio         seconds / ideal_s
  store_bytes   bytes the origin (the store's uplink) served; copies = store_bytes / M
and the models: one-to-many N*M/s, chain M/min(s, B) + (N-1)c/B, tree (fM + depth*c)/B
(PAPER.md, our derivation; with N = 1 the one receiver reads the store at s), the Kumar & Ross
lower bound max(M/s, N*M/(s + N*B)).
`--sweep_chunk_kb` then times the chain at N = --sweep_n for each chunk size: the chain
pays (N-1) c / B of pipeline fill plus a per-chunk cost (one HTTP request, a digest) M / c
times, so the best c balances the two (BUILD_NOTES, broadcast).
`--delta_versions=K` adds the delta arm (bridge/delta/, issue 24): a full version of the
same M, then K versions each stored as a delta on the previous one (a random
`--delta_density` of the bf16 elements replaced: bench.delta measures 1-4% per RL step
at lr 1e-6), each broadcast down the same chain of N = --delta_n relays on the same
rate-limited links, side by side: "chain-full" (the full version, every chunk) and
"chain-delta" (a delta version: its patches and dense tensors, each key verified against
the manifest on arrival). Per version: seconds, ideal_s = the bytes on each link / B, and
the model (M_delta / B + (N-1) c / B with c the largest key). Run only it with `--n=`.
A relay's token bucket starts a version full (`--burst_kb`, 1 MiB by default): a delta
near that size crosses a link as a burst, faster than B; `--burst_kb=256` (one piece, the
least) keeps the links at B for the delta arm too.
`--delta_patches=pieces,whole` runs the delta arm once per entry: "pieces" (a patch larger
than a chunk is stored in chunk-sized pieces, the default) and "whole" (every patch one
object, which crosses each hop whole before the next relay can start it).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time

from absl import app, flags

from bench import relay_procs
from bridge.broadcast import topology as topo
from bridge.store.weight_store import WeightStore
from rollout_gpu.peer_fetch import sources_for

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "JSON file for the results.", required=True)
flags.DEFINE_integer("model_mb", 40, "Model size M in MB (bf16 random weights).")
flags.DEFINE_integer("chunk_kb", 1024, "Chunk size c in KiB (the store's default is 4096).")
flags.DEFINE_float("up_mbps", 8.0, "Upload limit B of every relay, MB/s.")
flags.DEFINE_integer(
    "burst_kb", 1024, "Token-bucket burst of every relay's uplink, KiB (>= 256: one piece)."
)
flags.DEFINE_float(
    "store_mbps", 0.0, "The store's bandwidth s (origin uplink), MB/s; 0 = measure it."
)
flags.DEFINE_list("n", ["1", "2", "4", "8", "16"], "Relay counts N.")
flags.DEFINE_list("modes", ["store", "chain", "tree"], "Topologies.")
flags.DEFINE_integer("fanout", 2, "Tree fan-out f.")
flags.DEFINE_integer("repeats", 3, "Repeats per (N, mode); medians are reported.")
flags.DEFINE_list("sweep_chunk_kb", [], "Chunk sizes (KiB) to time the chain with at sweep_n.")
flags.DEFINE_integer("sweep_n", 8, "Receivers for the chunk-size sweep.")
flags.DEFINE_integer("delta_versions", 0, "Delta arm: delta versions after a full one (0 = off).")
flags.DEFINE_integer("delta_n", 8, "Delta arm: relays in the chain.")
flags.DEFINE_float("delta_density", 0.02, "Delta arm: fraction of elements each version changes.")
flags.DEFINE_list(
    "delta_patches", ["pieces"], "Delta arm, once per entry: 'pieces' (a patch larger than a "
    "chunk in chunk-sized pieces) and/or 'whole' (every patch one object per hop, as before)."
)  # fmt: skip
VERSION = 1
DELTA_FIRST = 1000  # the delta arm's versions: after any the sweep publishes


def _run(origin: str, relays: list[str], mode: str, fanout: int, version: int = VERSION) -> dict:
    t = topo.Topology(mode, fanout)
    for i, url in enumerate(relays):
        t.join(topo.Node(f"r{i}", url))
    for url in relays:
        relay_procs.call(url, "/forget", {"version": version})
    sha = relay_procs.manifest_sha(origin, version)
    before = relay_procs.call(origin, "/status")["bytes_up"]
    t0 = time.time()
    depth = 1
    for i, url in enumerate(relays):
        p = t.placement(f"r{i}")
        depth = max(depth, p.depth)
        srcs = sources_for(p.parent_url, p.fallback_urls, origin)
        relay_procs.call(url, "/fetch", {"version": version, "sources": srcs,
                                         "manifest_sha256": sha})  # fmt: skip
    done: dict[str, dict] = {}
    while len(done) < len(relays):
        time.sleep(0.05)
        for url in relays:
            v = relay_procs.call(url, "/status")["versions"].get(str(version))
            if v and v["failed"]:
                raise RuntimeError(f"{url}: {v['failed']}")
            if v and v["complete"]:
                done[url] = v
        if time.time() - t0 > 900:
            raise RuntimeError("broadcast did not finish in 15 min")
    origin_bytes = relay_procs.call(origin, "/status")["bytes_up"] - before
    # Each receiver's own fetch time: a link running at B takes M / B of it.
    own_s = [max(1e-9, v["completed_at"] - v["started_at"]) for v in done.values()]
    return {
        "seconds": max(v["completed_at"] for v in done.values()) - t0,
        "store_bytes": origin_bytes,
        "depth": depth,
        "fetch_s": own_s,
    }


def ideals(mode: str, n: int, m: float, c: float, b: float, f: int, depth: int, s: float) -> dict:
    one_to_many = n * m / s
    kumar_ross = max(m / s, n * m / (s + n * b))
    # Relays throttle uploads only: one receiver reads the store at s; with more, the chain
    # (or tree) runs at its slowest link, min(s, B).
    first = m / (s if n == 1 else min(s, b))
    model = {
        "store": one_to_many,
        "chain": first + (n - 1) * c / b,
        "tree": first if n == 1 else first + ((min(f, n - 1) - 1) * m + (depth - 1) * c) / b,
    }[mode]
    return {"model_s": model, "kumar_ross_s": kumar_ross, "one_to_many_s": one_to_many}


def measured_store_bytes_per_s(store: WeightStore, model_bytes: float, repeats: int = 3) -> float:
    """The store's own read throughput for the version: the median of `repeats` full,
    verified reads. Above what the relay processes can move on this box the CPU, not s,
    bounds the store arm (the link_MBps columns show it)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        store.read_all(VERSION)
        times.append(time.perf_counter() - t0)
    return model_bytes / statistics.median(times)


def _row(arm: str, n: int, runs: list[dict], m: float, c: float, b: float, s: float) -> dict:
    t = statistics.median(r["seconds"] for r in runs)
    ob = statistics.median(r["store_bytes"] for r in runs)
    ide = ideals(arm.split("-")[0], n, m, c, b, FLAGS.fanout, runs[0]["depth"], s)
    link = [m / s / 1e6 for r in runs for s in r["fetch_s"]]
    return {
        "arm": arm,
        "n": n,
        "chunk_bytes": c,
        "seconds": t,
        "ideal_s": m / b,
        "ratio": t / (m / b),
        "store_bytes": ob,
        "copies": ob / m,
        "link_MBps_median": statistics.median(link),
        "link_MBps_min": min(link),
        **ide,
        "ratio_kr": t / ide["kumar_ross_s"],
        "runs": runs,
    }


def _print_row(r: dict) -> None:
    print(
        f"{r['n']:>3} {r['arm']:>6} {r['chunk_bytes'] / 2**10:>6.0f} {r['seconds']:>8.2f} "
        f"{r['ideal_s']:>7.2f} {r['ratio']:>6.2f} {r['model_s']:>8.2f} "
        f"{r['one_to_many_s']:>8.2f} {r['store_bytes'] / 1e6:>9.1f} {r['copies']:>6.2f} "
        f"{r['link_MBps_median']:>6.2f} {r['link_MBps_min']:>6.2f}",
        flush=True,
    )


def delta_arm(store, origin, relays, load_origin, c: float, b: float, s: float,
              patches: str = "pieces", first: int = DELTA_FIRST) -> dict:  # fmt: skip
    """The full version and each delta version down one chain of --delta_n relays."""
    if patches not in ("pieces", "whole"):
        raise ValueError(f"--delta_patches entries are pieces|whole, got {patches!r}")
    manifests = relay_procs.publish_delta_chain(
        store, FLAGS.model_mb * 10**6, int(c), first, FLAGS.delta_versions,
        FLAGS.delta_density, None if patches == "pieces" else 1 << 40,
    )  # fmt: skip
    n, rows = FLAGS.delta_n, []
    print(f"delta arm ({patches} patches): chain N={n}, {FLAGS.delta_versions} delta versions "
          f"at density {FLAGS.delta_density}; ideal_s = the bytes on each link / B")  # fmt: skip
    for m in manifests:
        load_origin(m.version)
        runs = [_run(origin, relays[:n], "chain", FLAGS.fanout, m.version)
                for _ in range(FLAGS.repeats)]  # fmt: skip
        if m.delta is None:
            arm, wire, key = "chain-full", m.total_bytes, c
        else:
            arm, wire = "chain-delta", m.delta.nbytes
            kinds = m.delta.tensors.values()
            objects = [o for name, p in m.delta.tensors.items() for o in p.objects(0, name)]
            key = max([nbytes for _, _, nbytes in objects]
                      + [c for p in kinds if p.kind == "dense"] + [1])  # fmt: skip
        rows.append(_row(arm, n, runs, wire, float(key), b, s))
        rows[-1].update(version=m.version, full_bytes=m.total_bytes,
                        density=1.0 if m.delta is None else m.delta.density)  # fmt: skip
        _print_row(rows[-1])
    full_s = rows[0]["seconds"]
    delta_s = statistics.median(r["seconds"] for r in rows[1:])
    ratio = statistics.median(r["ideal_s"] * b / r["full_bytes"] for r in rows[1:])
    print(f"per version: full {full_s:.2f} s, delta {delta_s:.2f} s (median; "
          f"{100 * ratio:.1f}% of the bytes): {full_s / delta_s:.1f}x faster")  # fmt: skip
    return {"n": n, "density": FLAGS.delta_density, "patches": patches, "full_s": full_s,
            "delta_s_median": delta_s, "bytes_ratio_median": ratio,
            "speedup": full_s / delta_s, "rows": rows}  # fmt: skip


def main(argv):
    del argv
    tmp = tempfile.mkdtemp(prefix="bench_broadcast_")
    procs = []
    try:
        store = WeightStore(os.path.join(tmp, "store"))
        m = relay_procs.publish_model(store, FLAGS.model_mb * 10**6, FLAGS.chunk_kb << 10, VERSION)
        c, b = float(FLAGS.chunk_kb << 10), FLAGS.up_mbps * 1e6
        ns = sorted(int(x) for x in FLAGS.n)
        sweep = [int(k) for k in FLAGS.sweep_chunk_kb]
        s = FLAGS.store_mbps * 1e6 or measured_store_bytes_per_s(store, m)
        procs, origin = relay_procs.start_relays(1, s / 1e6, tmp, prefix="origin")
        count = max(ns + [FLAGS.sweep_n] + [FLAGS.delta_n] * bool(FLAGS.delta_versions))
        more, relays = relay_procs.start_relays(count, FLAGS.up_mbps, tmp, burst_kb=FLAGS.burst_kb)
        procs, origin = procs + more, origin[0]

        def load_origin(version: int) -> None:
            sha = relay_procs.manifest_sha(store, version)
            relay_procs.call(origin, "/fetch", {"version": version, "sources": [store.spec],
                                                "manifest_sha256": sha})  # fmt: skip
            while (
                not relay_procs.call(origin, "/status")["versions"]
                .get(str(version), {})
                .get("complete")
            ):
                time.sleep(0.1)

        load_origin(VERSION)
        rows = []
        print(f"M={m / 1e6:.1f} MB  c={c / 2**10:.0f} KiB  B={b / 1e6:.1f} MB/s  "
              f"s={s / 1e6:.1f} MB/s ({'given' if FLAGS.store_mbps else 'measured'})  "
              f"M/B={m / b:.1f} s  f={FLAGS.fanout}")  # fmt: skip
        hdr = f"{'N':>3} {'arm':>6} {'c_KiB':>6} {'seconds':>8} {'ideal_s':>7} {'ratio':>6} "
        print(hdr + f"{'model_s':>8} {'1toN_s':>8} {'store_MB':>9} {'copies':>6} "
              f"{'linkMB':>6} {'minMB':>6}")  # fmt: skip
        for n in ns:
            for arm in FLAGS.modes:
                runs = [_run(origin, relays[:n], arm, FLAGS.fanout) for _ in range(FLAGS.repeats)]
                rows.append(_row(arm, n, runs, m, c, b, s))
                _print_row(rows[-1])
        sweep_rows = []
        for i, kb in enumerate(sweep):
            version = VERSION + 1 + i
            mk = relay_procs.publish_model(store, FLAGS.model_mb * 10**6, kb << 10, version)
            load_origin(version)
            n = FLAGS.sweep_n
            runs = [
                _run(origin, relays[:n], "chain", FLAGS.fanout, version)
                for _ in range(FLAGS.repeats)
            ]
            sweep_rows.append(_row("chain", n, runs, mk, float(kb << 10), b, s))
            _print_row(sweep_rows[-1])
        delta = {}
        for i, patches in enumerate(FLAGS.delta_patches if FLAGS.delta_versions else []):
            first = DELTA_FIRST + i * (FLAGS.delta_versions + 1)
            delta[patches] = delta_arm(store, origin, relays, load_origin, c, b, s, patches, first)
        out = {
            "model_bytes": m,
            "chunk_bytes": c,
            "up_bytes_per_s": b,
            "store_bytes_per_s": s,
            "store_bandwidth": "given" if FLAGS.store_mbps else "measured",
            "fanout": FLAGS.fanout,
            "repeats": FLAGS.repeats,
            "cpu_count": os.cpu_count(),
            "load_average": os.getloadavg(),
            "rows": rows,
            "chunk_sweep": sweep_rows,
            "delta": delta,
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
