"""Per-chunk digest throughput: CRC-32 (today's chunk digest) vs SHA-256 vs BLAKE3.

Issue 23 item 1 asks for a cryptographic per-chunk digest, picked on speed because it runs on
the swap path (every chunk a worker loads is digested once, by the writer once). This times
each candidate over `--mib` MiB of random bytes cut into store-sized chunks
(`chunk_digest.CHUNK_BYTES`, 4 MiB), as the store and the relays digest them: one call per
chunk on a memoryview, single thread, best of `--repeats`. BLAKE3 is timed single-threaded
too (its `max_threads` default), since relays digest several chunks concurrently anyway.
BLAKE3 needs the `blake3` package; without it its row is skipped.

    python -m bench.digest --out=/tmp/digest.json [--mib=64] [--repeats=5]

Headline: `crc32_gb_s`, `sha256_gb_s`, `blake3_gb_s`, `fastest_cryptographic` (the one to
use), `crypto_vs_crc32` (its time per byte / CRC-32's; below 1 = faster than CRC-32).
"""

from __future__ import annotations

import hashlib
import json
import time
import zlib

import numpy as np
from absl import app, flags

from bridge.store.chunk_digest import CHUNK_BYTES

_OUT = flags.DEFINE_string("out", None, "JSON output path", required=True)
_MIB = flags.DEFINE_integer("mib", 64, "MiB of data digested per repeat")
_REPEATS = flags.DEFINE_integer("repeats", 5, "repeats; the best is kept")


def _digests() -> dict:
    out = {
        "crc32": lambda b: zlib.crc32(b),
        "sha256": lambda b: hashlib.sha256(b).digest(),
    }
    try:
        import blake3
    except ImportError:
        print("blake3 not installed (pip install blake3): its row is skipped")
    else:
        out["blake3"] = lambda b: blake3.blake3(b).digest()
    return out


def main(argv):
    del argv
    data = np.random.default_rng(0).integers(0, 256, _MIB.value << 20, np.uint8).tobytes()
    view = memoryview(data)
    chunks = [view[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]
    rows = []
    for name, fn in _digests().items():
        best = float("inf")
        for _ in range(_REPEATS.value):
            t0 = time.perf_counter()
            for c in chunks:
                fn(c)
            best = min(best, time.perf_counter() - t0)
        rows.append({"digest": name, "bytes": len(data), "seconds": best,
                     "gb_s": len(data) / best / 1e9, "cryptographic": name != "crc32"})  # fmt: skip
    print(f"{'digest':10s}{'GB/s':>10s}{'s / 64 MiB':>14s}")
    for r in rows:
        print(f"{r['digest']:10s}{r['gb_s']:10.2f}{r['seconds'] * (64 << 20) / r['bytes']:14.4f}")
    by = {r["digest"]: r for r in rows}
    crypto = min((r for r in rows if r["cryptographic"]), key=lambda r: r["seconds"])
    headline = {f"{n}_gb_s": round(r["gb_s"], 3) for n, r in by.items()}
    headline["fastest_cryptographic"] = crypto["digest"]
    headline["crypto_vs_crc32"] = round(crypto["seconds"] / by["crc32"]["seconds"], 2)
    print(f"fastest cryptographic: {crypto['digest']} ({headline['crypto_vs_crc32']}x CRC-32)")
    with open(_OUT.value, "w") as f:
        json.dump({"headline": headline, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
