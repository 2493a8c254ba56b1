"""Where a lease's time goes under load: `bench.controller_load` with each request timed.

    python -m bench.controller_lease_split --out=/tmp/split.json --workers=500 --gen_s=2.0 \
        --duration_s=60 --ramp_s=20        # any bench.controller_load flag

Wraps (in this process only, before the controller is built) the lean routes' thread
hand-off (`fast_routes.on_thread`),
`Controller.lease`/`submit`, `Controller._op` and `ControllerDB.sync`, and splits each
lease grant, refusal and submission into: waiting for a pool thread, waiting for the
controller's lock, the operation's SQL under the lock, its COMMIT, waiting for its fsync
(group commit) and getting back to the event loop (mean / p50 / p99 ms). Also writes
`<out>.split.json` and `<out>.series.json` (per lease: start, total, lock wait, pool wait,
fsync wait, lock held; seconds) to see whether slow leases come in bursts. The timing adds
to the latencies (~50% at 500 workers on 2 cores): compare phases, not absolute numbers
with an untimed run. BUILD_NOTES.md "Lease grants at 500 workers".
"""

from __future__ import annotations

import collections
import contextlib
import json
import sys
import threading
import time


def install():
    """Patch the classes; returns the per-request records."""
    from bridge.control.controller import Controller
    from bridge.control.http import fast_routes
    from bridge.control.state import db as db_lib

    pc, tl, records = time.perf_counter, threading.local(), []
    on_thread = fast_routes.on_thread

    async def timed_on_thread(lane, fn, *args):
        if getattr(fn, "__name__", "") not in ("lease", "_submit", "timed"):
            return await on_thread(lane, fn, *args)
        t = {"enter": pc()}

        def inner():
            t["thread_start"], tl.ph = pc(), t
            try:
                return fn(*args)
            finally:
                tl.ph, t["thread_end"] = None, pc()

        out = await on_thread(lane, inner)
        t["resumed"] = pc()
        records.append(t)
        return out

    fast_routes.on_thread = timed_on_thread

    def kind_of(name, real):
        def op(self, worker_id, req):
            ph = getattr(tl, "ph", None)
            if ph is not None:
                ph["kind"], ph["ops"] = name, []
            r = real(self, worker_id, req)
            if ph is not None and name == "lease":
                ph["grant"] = r.lease is not None
            return r

        return op

    Controller.lease = kind_of("lease", Controller.lease)
    Controller.submit = kind_of("submit", Controller.submit)

    @contextlib.contextmanager
    def _op(self, durable=True):  # Controller._op, timed
        ph, t0 = getattr(tl, "ph", None), pc()
        with self.lock:
            t1 = pc()
            with self.db.tx():
                for worker_id, version, at in self.workers.hot.take_swaps():
                    self.fleet.swapped(worker_id, version, at)
                yield
                t2 = pc()
            t3 = pc()
        if durable and not self.db.conn.in_transaction:
            self.db.sync()
        if ph is not None and "ops" in ph and not self.db.conn.in_transaction:
            ph["ops"].append((t0, t1, t2, t3))

    Controller._op = _op
    sync = db_lib.ControllerDB.sync

    def timed_sync(self):
        ph, t0 = getattr(tl, "ph", None), pc()
        sync(self)
        if ph is not None:
            ph.setdefault("syncs", []).append(pc() - t0)

    db_lib.ControllerDB.sync = timed_sync
    return records


def split(records, kind, grant=None) -> dict:
    import numpy as np

    rows = [
        t
        for t in records
        if t.get("kind") == kind and "ops" in t and (grant is None or t.get("grant") == grant)
    ]
    phases = collections.defaultdict(list)
    for t in rows:
        phases["pool_thread_wait"].append(t["thread_start"] - t["enter"])
        phases["lock_wait"].append(sum(o[1] - o[0] for o in t["ops"]))
        phases["sql_under_lock"].append(sum(o[2] - o[1] for o in t["ops"]))
        phases["commit"].append(sum(o[3] - o[2] for o in t["ops"]))
        phases["fsync_wait"].append(sum(t.get("syncs", [])))
        phases["back_to_loop"].append(t["resumed"] - t["thread_end"])
        phases["total"].append(t["resumed"] - t["enter"])
    print(f"\n== {kind}{'' if grant is None else ' grant' if grant else ' refusal'} n={len(rows)}")
    out = {}
    for k, v in phases.items():
        a = np.asarray(v) * 1e3
        out[k] = [float(a.mean()), float(np.percentile(a, 50)), float(np.percentile(a, 99))]
        print(f"  {k:<18}{out[k][0]:9.2f}{out[k][1]:9.2f}{out[k][2]:9.2f}  (mean/p50/p99 ms)")
    return out


def main(argv=None):
    from bench import controller_load

    argv = sys.argv[1:] if argv is None else argv
    out = controller_load.parse_args(argv).out
    records = install()
    controller_load.main(argv)
    result = {
        "lease_grant": split(records, "lease", True),
        "lease_refusal": split(records, "lease", False),
        "submit": split(records, "submit"),
    }
    with open(out + ".split.json", "w") as f:
        json.dump(result, f, indent=1)
    series = [
        (
            t["enter"],
            t["resumed"] - t["enter"],
            sum(o[1] - o[0] for o in t["ops"]),
            t["thread_start"] - t["enter"],
            sum(t.get("syncs", [])),
            sum(o[3] - o[1] for o in t["ops"]),
        )
        for t in records
        if t.get("kind") == "lease" and "ops" in t
    ]
    with open(out + ".series.json", "w") as f:
        json.dump(series, f)


if __name__ == "__main__":
    main()
