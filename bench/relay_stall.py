"""An honest child's chunk time from a relay, idle and while readers that never read hold
connections to it (rollout_gpu/uplink.py: per-reader slots).

    python -m bench.relay_stall --out=/tmp/relay_stall.json [--stalled=2 --reps=5]

One relay as a worker runs it (no upload limit, default slots) holding one version of a
single 4 MiB chunk from a local file store; each stalled reader connects from its own
loopback address (127.0.0.2, ...) with a 4 KiB receive buffer, asks for the chunk and never
reads. The child GETs the chunk with a 10 s read timeout (a timeout counts as 10 s and
`ok` false). Prints a table and writes {"headline": {...}, "rows": [...]}.
"""

from __future__ import annotations

import json
import socket
import statistics
import tempfile
import time

import httpx
import numpy as np
from absl import app, flags

from bridge.store import chunk_digest
from bridge.store.weight_store import WeightStore
from rollout_gpu.relay import Relay

flags.DEFINE_string("out", "", "write the JSON here")
flags.DEFINE_integer("stalled", 2, "readers that never read")
flags.DEFINE_integer("reps", 5, "chunk GETs per arm")
FLAGS = flags.FLAGS
CHUNK = 4 << 20
TIMEOUT_S = 10.0


def _stall(relay: Relay, key: str, address: str) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.bind((address, 0))
    s.connect((relay.host, int(relay.url.rsplit(":", 1)[1])))
    s.sendall(f"GET /kv/{key} HTTP/1.1\r\nHost: relay\r\n\r\n".encode())
    return s


def _times(relay: Relay, key: str, want: bytes, reps: int) -> list[dict]:
    rows = []
    for _ in range(reps):
        t0 = time.monotonic()
        try:
            r = httpx.get(f"{relay.url}/kv/{key}", timeout=TIMEOUT_S)
            ok = r.status_code == 200 and r.content == want
        except httpx.TimeoutException:
            ok = False
        rows.append({"seconds": min(time.monotonic() - t0, TIMEOUT_S), "ok": ok})
    return rows


def main(argv):
    del argv
    chunk_digest.CHUNK_BYTES = CHUNK
    with tempfile.TemporaryDirectory() as tmp:
        store = WeightStore(f"{tmp}/store")
        a = np.random.default_rng(0).standard_normal((CHUNK // 2048, 1024)).astype(np.float32)
        store.publish(1, 1, [("a", a)], {}, dtype="bfloat16")
        relay = Relay()
        relay.start()
        try:
            relay.fetch(1, [store.spec], timeout=60)
            [key] = [k for k in relay.versions[1].plan if "/a/" in k]
            want = store.kv.read(key).result().value
            rows = [{"arm": "idle", **r} for r in _times(relay, key, want, FLAGS.reps)]
            hogs = [_stall(relay, key, f"127.0.0.{2 + i}") for i in range(FLAGS.stalled)]
            while relay.status()["clients"] < FLAGS.stalled:
                time.sleep(0.01)
            arm = f"{FLAGS.stalled}_stalled"
            rows += [{"arm": arm, **r} for r in _times(relay, key, want, FLAGS.reps)]
            for h in hogs:
                h.close()
        finally:
            relay.stop()
    med = {
        a: statistics.median(r["seconds"] for r in rows if r["arm"] == a)
        for a in dict.fromkeys(r["arm"] for r in rows)
    }
    headline = {
        "chunk_s_idle": med["idle"],
        "chunk_s_stalled": med[arm],
        "all_ok": all(r["ok"] for r in rows),
    }
    print(f"{'arm':>12} {'median s':>9} {'max s':>7} ok")
    for a, m in med.items():
        these = [r for r in rows if r["arm"] == a]
        print(f"{a:>12} {m:9.3f} {max(r['seconds'] for r in these):7.3f} "
              f"{all(r['ok'] for r in these)}")  # fmt: skip
    if FLAGS.out:
        with open(FLAGS.out, "w") as f:
            json.dump({"headline": headline, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
