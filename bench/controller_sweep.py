"""`python -m bench.controller_load --sweep --out=F.json [--baseline=DIR --duration_s=60]`

The controller load bench (bench/controller_load.py) at 100, 500, 1000 and 2000 simulated
workers at a realistic cadence (`--gen_s=20` per lease), plus the old saturating cadence
(500 workers at `--gen_s=2.0`), each arm in a fresh process. Per arm: accepted
submissions/s, p50/p99 per endpoint, 5xx, the controller's and the clients' CPU (cores:
CPU-s / wall-s; the clients run in one process per 700 workers so they are not the limit),
and the independent SQLite audit. With `--baseline=DIR` (a checkout of the previous
release, e.g. `git worktree add --detach /tmp/base 1ea3146`) every arm runs there too,
side by side, under the same load. The 2000-worker p99 is printed last.

Goals (issue 25): 500 @ 2.0 s: p99 heartbeat and lease <= 250 ms and >= 200 accepted
submissions/s; 2000 @ 20 s: p99 <= 250 ms, 0 5xx, audit clean.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

ARMS = [(100, 20.0), (500, 20.0), (1000, 20.0), (500, 2.0), (2000, 20.0)]  # 2000 last
ENDPOINTS = ("/v1/heartbeat", "/v1/lease", "/v1/submit")


def _arm(cwd: str, workers: int, gen_s: float, duration_s: float, ramp_s: float) -> dict:
    out = tempfile.mktemp(prefix=f"sweep_{workers}_{gen_s}_", suffix=".json")
    cmd = [
        sys.executable, "-m", "bench.controller_load", f"--out={out}",
        f"--workers={workers}", f"--gen_s={gen_s}", f"--duration_s={duration_s}",
        f"--ramp_s={ramp_s}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": cwd}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(out):
        return {"error": proc.stderr[-2000:]}
    with open(out) as f:
        r = json.load(f)
    os.remove(out)
    return summary(r)


def summary(r: dict) -> dict:
    cpu, wall = r["cpu_s"], r["wall_s"]
    return {
        "submissions_per_s": r["submissions_per_s"],
        "server_5xx": r["server_5xx"],
        "transport_errors": r["transport_errors"],
        "audit_ok": r["audit"]["ok"],
        "audit": r["audit"],
        "controller_cores": cpu["controller"] / wall,
        "reward_pool_cores": cpu["reward_pool"] / wall,
        "client_cores": cpu["clients"] / wall,
        "loadavg_after": cpu["loadavg_after"],
        "group_commit": r.get("group_commit"),
        "endpoints": {
            ep: {k: r["endpoints"][ep][k] for k in ("p50_ms", "p99_ms", "per_s")}
            for ep in ENDPOINTS
            if ep in r["endpoints"]
        },
    }


def _row(name: str, a: dict) -> str:
    if "error" in a:
        return f"{name:<22} error: {a['error'][-300:]}"
    e = a["endpoints"]
    lat = "".join(
        f"{e[ep]['p50_ms']:>8.0f}{e[ep]['p99_ms']:>8.0f}" if ep in e else f"{'-':>16}"
        for ep in ENDPOINTS
    )
    audit = "OK" if a["audit_ok"] else "FAIL"
    return (
        f"{name:<22}{a['submissions_per_s']:>7.1f}{lat}{a['server_5xx']:>5}"
        f"{a['controller_cores']:>7.2f}{a['client_cores']:>7.2f}  {audit}"
    )


def main(args, argv: list[str]) -> dict:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = {"arms": [], "params": {"duration_s": args.duration_s, "ramp_s": args.ramp_s}}
    for workers, gen_s in ARMS:
        arm = {"workers": workers, "gen_s": gen_s}
        arm["new"] = _arm(here, workers, gen_s, args.duration_s, args.ramp_s)
        if args.baseline:
            arm["baseline"] = _arm(args.baseline, workers, gen_s, args.duration_s, args.ramp_s)
        result["arms"].append(arm)
        with open(args.out, "w") as f:  # partial results survive an interrupted sweep
            json.dump(result, f, indent=1)
    head = f"{'arm':<22}{'subm/s':>7}" + "".join(
        f"{ep.split('/')[-1][:5] + ' p50':>8}{'p99':>8}" for ep in ENDPOINTS
    )
    print(head + f"{'5xx':>5}{'ctl c':>7}{'cli c':>7}  audit")
    for arm in result["arms"]:
        name = f"{arm['workers']} @ {arm['gen_s']:g}s"
        print(_row(name + " new", arm["new"]))
        if "baseline" in arm:
            print(_row(name + " base", arm["baseline"]))
    last = result["arms"][-1]
    for kind in ("baseline", "new"):
        a = last.get(kind)
        if a and "endpoints" in a:
            p99 = {ep.split("/")[-1]: round(v["p99_ms"]) for ep, v in a["endpoints"].items()}
            result[f"p99_ms_2000_{kind}"] = p99
            print(f"2000 workers @ gen_s=20, {kind}: p99 ms {p99}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return result
