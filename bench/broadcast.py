"""Broadcast benchmark: one weight version from the store to N relays, store vs chain vs tree.

    python -m bench.broadcast --out=/tmp/bench_broadcast.json [--model_mb=40] [--up_mbps=8]
        [--chunk_kb=1024] [--n=1,2,4,8,16] [--modes=store,chain,tree] [--fanout=2]
        [--repeats=3] [--sweep_chunk_kb=256,1024,4096] [--sweep_n=8]
        [--delta_versions=3] [--delta_n=8] [--delta_density=0.02] [--delta_patches=pieces,whole]
        [--netns] [--learner_mbps=4] [--net_faults] [--fault_s=3]

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
`--delta_versions=K` adds the delta arm (bridge/weights/, issue 24): a full version of the
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

`--netns` (root; bench/netbed.py) runs the same arms over real kernel links instead of
loopback: the store's origin relay, a learner host and every relay each in its own network
namespace on a bridge, every host's uplink shaped by the kernel (htb: s for the store,
--learner_mbps for the learner, B for each relay; downlinks free, as the bound assumes), the
relays with no token bucket of their own. s is a rate here (--store_mbps, default B), not
measured. Each version is published by the learner's host to the store's over its thin
uplink before it is broadcast (`netns.publish` in the JSON: seconds and M / learner rate).
Headline: `netns_chain_vs_bound` (the chain's seconds over the Kumar & Ross bound, largest
N) and `netns_delta_time_ratio` (a delta version's chain seconds over the full version's;
the delta arm runs with --delta_versions=3 unless given). The kernel has no netem here, so
links add no delay (bench/netbed.py). For example:

    python -m bench.broadcast --netns --out=/tmp/bench_broadcast_netns.json --model_mb=8 \
        --up_mbps=2 --chunk_kb=256 --n=1,2,4,8 --repeats=2 --delta_n=8

`--net_faults` then runs the chain of the largest N once under each network fault: its
middle relay cut off for --fault_s while it holds a quarter to three quarters of the
version, that relay's uplink 10x slower, and the learner's uplink flapping (3 x 1 s down)
while it publishes a version; rows `chain-partition`, `chain-slow`, `publish-flap`.
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
import threading
import time

from absl import app, flags

from bench import netbed, relay_procs
from bench.broadcast_run import ideals
from bench.broadcast_run import run_once as _run
from bridge.store.weight_store import WeightStore

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
flags.DEFINE_bool(
    "netns",
    False,
    "Real kernel links (bench/netbed.py): each relay, the store and the "
    "learner in its own network namespace, rates shaped by htb; needs root.",
)
flags.DEFINE_float(
    "learner_mbps", 4.0, "--netns: the learner host's uplink, MB/s (it publishes to the store)."
)
flags.DEFINE_bool(
    "net_faults",
    False,
    "--netns: also run the chain of the largest N under network faults "
    "(a middle relay partitioned mid-version, one relay's uplink 10x slower, the learner's "
    "uplink flapping while it publishes).",
)
flags.DEFINE_float("fault_s", 3.0, "--net_faults: seconds the relay stays partitioned.")
flags.DEFINE_list(
    "delta_patches", ["pieces"], "Delta arm, once per entry: 'pieces' (a patch larger than a "
    "chunk in chunk-sized pieces) and/or 'whole' (every patch one object per hop, as before)."
)  # fmt: skip
VERSION = 1
FLAP_VERSION = 900  # --net_faults publishes it through the flapping uplink
DELTA_FIRST = 1000  # the delta arm's versions: after any the sweep publishes


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


def netns_headline(rows: list[dict], delta: dict) -> dict:
    """The chain's time over the Kumar & Ross bound at the largest N, and a delta version's
    broadcast time over the full version's (the first --delta_patches entry)."""
    chain = [r for r in rows if r["arm"] == "chain"]
    top = max(chain, key=lambda r: r["n"]) if chain else None
    arm = next(iter(delta.values()), None)
    return {
        "netns_chain_vs_bound": top["seconds"] / top["kumar_ross_s"] if top else None,
        "netns_chain_n": top["n"] if top else None,
        "netns_delta_time_ratio": arm["delta_s_median"] / arm["full_s"] if arm else None,
    }


def fault_arm(bed, origin, relays, load_origin, publish, m, c, b, s) -> list[dict]:
    """The chain of len(`relays`) under each network fault (bench/netbed.py), once each:
    every relay must still end with the version verified. Rows as the arms' (one run)."""
    n, mid = len(relays), len(relays) // 2
    host, rows = f"r{mid}", []

    def holds_part() -> bool:  # the middle relay holds a quarter to three quarters
        v = relay_procs.call(relays[mid], "/status")["versions"].get(str(VERSION))
        return bool(v) and not v["complete"] and v["total"] // 4 <= v["have"] <= 3 * v["total"] // 4

    done: list[dict] = []
    cut = threading.Thread(
        target=lambda: done.append(netbed.partition_when(bed, host, holds_part, FLAGS.fault_s))
    )
    cut.start()
    runs = [_run(origin, relays, "chain", FLAGS.fanout)]
    cut.join()
    rows.append(_row("chain-partition", n, runs, m, c, b, s) | {"fault": done[0]})
    fault = netbed.slow(bed, host, 10.0)
    try:
        runs = [_run(origin, relays, "chain", FLAGS.fanout)]
    finally:
        netbed.restore(bed, fault)
    rows.append(_row("chain-slow", n, runs, m, c, b, s) | {"fault": fault})
    flapping = threading.Thread(target=lambda: done.append(netbed.flap(bed, "learner")))
    flapping.start()
    load_origin(FLAP_VERSION)  # the learner publishes through its flapping uplink
    flapping.join()
    rows.append({"arm": "publish-flap", "n": 1, "fault": done[-1], **publish[-1]})
    for r in rows[:2]:
        _print_row(r)
    print(f"publish through a flapping uplink: {publish[-1]['seconds']:.2f} s "
          f"(M / learner rate {publish[-1]['ideal_s']:.2f} s)")  # fmt: skip
    return rows


def start_netns(count: int, s: float, tmp: str):
    """The testbed: the store's host (uplink s), the learner's (--learner_mbps) and `count`
    relays (uplink B), each a relay process in its own namespace; returns the bed (entered),
    the processes and the origin, learner and relay URLs."""
    hosts = {"store": s / 1e6, "learner": FLAGS.learner_mbps}
    hosts.update({f"r{i}": FLAGS.up_mbps for i in range(count)})
    bed = netbed.Netbed(hosts).__enter__()
    try:
        procs, urls = relay_procs.start_relays_in(bed, list(hosts), tmp)
    except BaseException:
        bed.close()
        raise
    return bed, procs, urls[0], urls[1], urls[2:]


def main(argv):
    del argv
    if FLAGS.netns and (reason := netbed.unavailable()):
        raise SystemExit(f"--netns: {reason}")
    if FLAGS.netns and not FLAGS["delta_versions"].present:
        FLAGS.delta_versions = 3  # the headline's delta ratio needs the delta arm
    tmp = tempfile.mkdtemp(prefix="bench_broadcast_")
    procs, bed, publish = [], None, []
    try:
        store = WeightStore(os.path.join(tmp, "store"))
        m = relay_procs.publish_model(store, FLAGS.model_mb * 10**6, FLAGS.chunk_kb << 10, VERSION)
        c, b = float(FLAGS.chunk_kb << 10), FLAGS.up_mbps * 1e6
        ns = sorted(int(x) for x in FLAGS.n)
        sweep = [int(k) for k in FLAGS.sweep_chunk_kb]
        count = max(ns + [FLAGS.sweep_n] + [FLAGS.delta_n] * bool(FLAGS.delta_versions))
        if FLAGS.netns:
            # the kernel shapes every uplink: s must be a rate, not the disk's read speed
            s = (FLAGS.store_mbps or FLAGS.up_mbps) * 1e6
            bed, procs, origin, learner, relays = start_netns(count, s, tmp)
        else:
            s = FLAGS.store_mbps * 1e6 or measured_store_bytes_per_s(store, m)
            procs, origin = relay_procs.start_relays(1, s / 1e6, tmp, prefix="origin")
            more, relays = relay_procs.start_relays(
                count, FLAGS.up_mbps, tmp, burst_kb=FLAGS.burst_kb
            )
            procs, origin = procs + more, origin[0]

        def load_origin(version: int) -> None:
            sha = relay_procs.manifest_sha(store, version)
            if not FLAGS.netns:
                relay_procs.call(origin, "/fetch", {"version": version, "sources": [store.spec],
                                                    "manifest_sha256": sha})  # fmt: skip
                relay_procs.wait_complete(origin, version)
                return
            # the learner's host reads its own disk, then publishes over its thin uplink
            relay_procs.call(learner, "/fetch", {"version": version, "sources": [store.spec],
                                                 "manifest_sha256": sha})  # fmt: skip
            relay_procs.wait_complete(learner, version)
            relay_procs.call(origin, "/fetch", {"version": version, "sources": [learner],
                                                "manifest_sha256": sha})  # fmt: skip
            seconds = relay_procs.wait_complete(origin, version)
            man = store.manifest(version)
            nbytes = man.delta.nbytes if man.delta is not None else man.total_bytes
            publish.append({"version": version, "seconds": seconds, "bytes": nbytes,
                            "ideal_s": nbytes / (FLAGS.learner_mbps * 1e6)})  # fmt: skip

        load_origin(VERSION)
        rows = []
        how = "kernel" if FLAGS.netns else "given" if FLAGS.store_mbps else "measured"
        print(f"M={m / 1e6:.1f} MB  c={c / 2**10:.0f} KiB  B={b / 1e6:.1f} MB/s  "
              f"s={s / 1e6:.1f} MB/s ({how})  "
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
        faults = []
        if FLAGS.netns and FLAGS.net_faults:
            relay_procs.publish_model(store, FLAGS.model_mb * 10**6, int(c), FLAP_VERSION)
            faults = fault_arm(bed, origin, relays[: ns[-1]], load_origin, publish, m, c, b, s)
        delta = {}
        for i, patches in enumerate(FLAGS.delta_patches if FLAGS.delta_versions else []):
            first = DELTA_FIRST + i * (FLAGS.delta_versions + 1)
            delta[patches] = delta_arm(store, origin, relays, load_origin, c, b, s, patches, first)
        out = {
            "model_bytes": m,
            "chunk_bytes": c,
            "up_bytes_per_s": b,
            "store_bytes_per_s": s,
            "store_bandwidth": how,
            "fanout": FLAGS.fanout,
            "repeats": FLAGS.repeats,
            "cpu_count": os.cpu_count(),
            "load_average": os.getloadavg(),
            "rows": rows,
            "chunk_sweep": sweep_rows,
            "delta": delta,
            "net_faults": faults,
        }
        if FLAGS.netns:
            out["headline"] = netns_headline(rows, delta)
            out["netns"] = {
                "kernel_qdiscs": netbed.kernel_qdiscs(),
                "publish": publish,
                "learner_up_bytes_per_s": FLAGS.learner_mbps * 1e6,
                "hosts": dict(bed.up),
                "shaping": "htb on each host's uplink",
            }
            print("  ".join(f"{k}={v}" for k, v in out["headline"].items()))
        with open(FLAGS.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {FLAGS.out}")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=10)
        if bed is not None:
            bed.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    app.run(main)
