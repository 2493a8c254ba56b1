"""`python -m bench.controller_load --sweep --out=F.json [--baseline=DIR --duration_s=60]`

The controller load bench (bench/controller_load.py) at 100, 500, 1000 and 2000 simulated
workers at a realistic cadence (`--gen_s=20` per lease), plus the saturating cadence (500
workers at `--gen_s=2.0`, arm `500_fast`), each run in a fresh process. Per arm: accepted
submissions/s, p50/p99 per endpoint, 5xx, the controller's and the clients' CPU (cores:
CPU-s / wall-s; the clients run in one process per 700 workers so they are not the limit),
the independent SQLite audit and the load average before and after.

`--baseline=DIR` (a checkout of the previous release, e.g. `git worktree add --detach
/tmp/base REV`) runs every arm there too, alternating with this tree under the same load,
`--repeats` times each (medians reported): the machine's load moves both alike, so the
ratios ours / baseline are what to read on a shared box. `--arms=NAME:W@G,...` replaces
the arms (a test's tiny sweep).

JSON (the bench contract, DESIGN.md): `{"headline": {...}, "rows": [...]}`; one row per arm
and tree, and `commits` (each tree's commit, for numbers quoted elsewhere). Headline:
`p99_ms_2000` and `p99_ms_500_fast` (the worst p99 of heartbeat, lease and submit in that
arm), `submissions_per_s_500_fast`, `audit_clean` (every run's audit), `errors_5xx` (over
every run of this tree); with a baseline also `<key>_baseline` and `ratio_<key>` (ours /
baseline) for the three numbers.

Goals: 500 @ 2.0 s: every p99 <= 250 ms and >= 200 accepted submissions/s; 2000 @ 20 s:
every p99 <= 250 ms; 0 5xx, audit clean.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

ARMS = "100:100@20,500:500@20,1000:1000@20,500_fast:500@2,2000:2000@20"
ENDPOINTS = ("/v1/heartbeat", "/v1/lease", "/v1/submit")
RATIO_KEYS = ("p99_ms_2000", "p99_ms_500_fast", "submissions_per_s_500_fast")


def parse_arms(text: str) -> list[tuple[str, int, float]]:
    """`NAME:WORKERS@GEN_S,...` -> [(name, workers, gen_s)]."""
    arms = []
    for item in text.split(","):
        name, _, spec = item.strip().partition(":")
        workers, _, gen_s = spec.partition("@")
        arms.append((name, int(workers), float(gen_s)))
    return arms


def _arm(cwd: str, workers: int, gen_s: float, args) -> dict:
    out = tempfile.mktemp(prefix=f"sweep_{workers}_{gen_s}_", suffix=".json")
    cmd = [
        sys.executable, "-m", "bench.controller_load", f"--out={out}",
        f"--workers={workers}", f"--gen_s={gen_s}", f"--duration_s={args.duration_s}",
        f"--ramp_s={args.ramp_s}", f"--groups_per_step={args.groups_per_step}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": cwd}
    load_before = os.getloadavg()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not os.path.exists(out):
        return {"error": proc.stderr[-2000:]}
    with open(out) as f:
        r = json.load(f)
    os.remove(out)
    return {**summary(r), "loadavg_before": load_before}


def _commit(cwd: str) -> str:
    """The tree's checked-out commit (with "+dirty" when it has uncommitted changes)."""
    git = lambda *a: subprocess.run(("git", *a), cwd=cwd, capture_output=True, text=True)  # noqa: E731
    rev = git("rev-parse", "--short", "HEAD").stdout.strip() or "unknown"
    return rev + ("+dirty" if git("status", "--porcelain", "--untracked-files=no").stdout else "")


def summary(r: dict) -> dict:
    cpu, wall = r["cpu_s"], r["wall_s"]
    endpoints = {
        ep: {k: r["endpoints"][ep][k] for k in ("p50_ms", "p99_ms", "per_s")}
        for ep in ENDPOINTS
        if ep in r["endpoints"]
    }
    return {
        "submissions_per_s": r["submissions_per_s"],
        "p99_ms": max((e["p99_ms"] for e in endpoints.values()), default=float("nan")),
        "server_5xx": r["server_5xx"],
        "transport_errors": r["transport_errors"],
        "audit_ok": r["audit"]["ok"],
        "audit": r["audit"],
        "controller_cores": cpu["controller"] / wall,
        # CPU per unit of work, less sensitive to a shared box than rates and latencies:
        # the controller process's CPU seconds (reward pool excluded) over the whole run
        # per group accepted (one group per submission at the default --max_groups=1).
        "controller_cpu_ms_per_group": 1e3 * cpu["controller"] / max(1, r["groups_accepted"]),
        "reward_pool_cores": cpu["reward_pool"] / wall,
        "client_cores": cpu["clients"] / wall,
        "loadavg_after": cpu["loadavg_after"],
        "group_commit": r.get("group_commit"),
        "endpoints": endpoints,
    }


def _median_row(name: str, tree: str, workers: int, gen_s: float, runs: list[dict]) -> dict:
    """One row per arm and tree: medians over the repeats (errors and audits: all of them)."""
    ok = [r for r in runs if "error" not in r]
    row = {"arm": name, "tree": tree, "workers": workers, "gen_s": gen_s, "runs": runs}
    if not ok:
        return {**row, "error": runs[-1]["error"]}
    med = lambda f: statistics.median(f(r) for r in ok)  # noqa: E731
    row.update(
        submissions_per_s=med(lambda r: r["submissions_per_s"]),
        p99_ms=med(lambda r: r["p99_ms"]),
        server_5xx=sum(r["server_5xx"] for r in ok),
        transport_errors=sum(r["transport_errors"] for r in ok),
        audit_ok=all(r["audit_ok"] for r in ok) and len(ok) == len(runs),
        controller_cores=med(lambda r: r["controller_cores"]),
        controller_cpu_ms_per_group=med(lambda r: r.get("controller_cpu_ms_per_group", 0.0)),
        client_cores=med(lambda r: r["client_cores"]),
        loadavg=[r["loadavg_before"][0] for r in ok] + [ok[-1]["loadavg_after"][0]],
        endpoints={
            ep: {
                k: statistics.median(r["endpoints"][ep][k] for r in ok if ep in r["endpoints"])
                for k in ("p50_ms", "p99_ms", "per_s")
            }
            for ep in ENDPOINTS
            if any(ep in r["endpoints"] for r in ok)
        },
    )
    return row


def headline(rows: list[dict]) -> dict:
    """The contract's keys from the rows (see the module docstring)."""
    head = {}
    for tree, suffix in (("new", ""), ("baseline", "_baseline")):
        mine = {r["arm"]: r for r in rows if r["tree"] == tree}
        if not mine:
            continue
        slow, fast = mine.get("2000", {}), mine.get("500_fast", {})
        head[f"p99_ms_2000{suffix}"] = slow.get("p99_ms")
        head[f"p99_ms_500_fast{suffix}"] = fast.get("p99_ms")
        head[f"submissions_per_s_500_fast{suffix}"] = fast.get("submissions_per_s")
        head[f"audit_clean{suffix}"] = all(r.get("audit_ok") is True for r in mine.values())
        head[f"errors_5xx{suffix}"] = sum(r.get("server_5xx", 0) for r in mine.values())
    if "audit_clean_baseline" in head:
        for key in RATIO_KEYS:
            ours, base = head.get(key), head.get(f"{key}_baseline")
            head[f"ratio_{key}"] = ours / base if ours is not None and base else None
    for row in rows:  # each arm against the baseline's same arm
        base = next((b for b in rows if b["tree"] == "baseline" and b["arm"] == row["arm"]), None)
        if row["tree"] == "new" and base is not None and "error" not in base | row:
            row["ratio_p99_ms"] = row["p99_ms"] / base["p99_ms"] if base["p99_ms"] else None
            ours_cpu, base_cpu = (r.get("controller_cpu_ms_per_group") for r in (row, base))
            row["ratio_controller_cpu_ms_per_group"] = (
                ours_cpu / base_cpu if ours_cpu is not None and base_cpu else None
            )
            row["ratio_submissions_per_s"] = (
                row["submissions_per_s"] / base["submissions_per_s"]
                if base["submissions_per_s"]
                else None
            )
    return head


def _line(r: dict) -> str:
    name = f"{r['arm']} ({r['workers']} @ {r['gen_s']:g}s) {r['tree']}"
    if "error" in r:
        return f"{name:<34} error: {r['error'][-300:]}"
    e = r["endpoints"]
    lat = "".join(
        f"{e[ep]['p50_ms']:>10.0f}{e[ep]['p99_ms']:>8.0f}" if ep in e else f"{'-':>18}"
        for ep in ENDPOINTS
    )
    ratio = r.get("ratio_p99_ms")
    return (
        f"{name:<34}{r['submissions_per_s']:>7.1f}{lat}{r['server_5xx']:>5}"
        f"{r['controller_cores']:>7.2f}{r['controller_cpu_ms_per_group']:>7.2f}"
        f"{r['client_cores']:>7.2f}  "
        f"{'OK' if r['audit_ok'] else 'FAIL':<5}{'' if ratio is None else f'{ratio:>7.2f}'}"
        f"  load {'/'.join(f'{x:.1f}' for x in r['loadavg'])}"
    )


def main(args, argv: list[str]) -> dict:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = [("new", here)] + ([("baseline", os.path.abspath(args.baseline))] * bool(args.baseline))
    rows = []
    commits = {tree: _commit(cwd) for tree, cwd in trees}  # what the numbers were measured at
    result = {"headline": {}, "rows": rows, "params": vars(args), "commits": commits}
    for name, workers, gen_s in parse_arms(args.arms or ARMS):
        runs = {tree: [] for tree, _ in trees}
        for i in range(args.repeats):  # alternate the trees, the first one by turns
            for tree, cwd in trees if i % 2 == 0 else trees[::-1]:
                runs[tree].append(_arm(cwd, workers, gen_s, args))
        rows += [_median_row(name, tree, workers, gen_s, runs[tree]) for tree, _ in trees]
        result["headline"] = headline(rows)
        with open(args.out, "w") as f:  # partial results survive an interrupted sweep
            json.dump(result, f, indent=1)
    head = f"{'arm':<34}{'subm/s':>7}" + "".join(
        f"{ep.split('/')[-1][:5] + ' p50':>10}{'p99':>8}" for ep in ENDPOINTS
    )
    print(head + f"{'5xx':>5}{'ctl c':>7}{'ms/grp':>7}{'cli c':>7}  audit  p99 ours/base")
    for r in rows:
        print(_line(r))
    print("headline: " + json.dumps(result["headline"]))
    print("commits: " + json.dumps(commits))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return result
