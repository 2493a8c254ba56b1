"""Controller load: hundreds of simulated rollout workers against the real controller.

    python -m bench.controller_load --out=/tmp/controller_load.json \
        [--workers=500 --duration_s=120 --gen_s=2.0 --groups_per_step=256]

The real controller (bridge/control: SQLite store on disk, rewards scored in the reward
process pool from decoded completions, the HTTP service on loopback with its abuse limits
at their defaults) serves `--workers` simulated workers (bench/load_client.py: aiohttp in
a second process) that register, heartbeat, lease, "generate" for `--gen_s` and submit
complete groups built from the leased prompt ids. A learner thread takes batches
(`wait_batch`) and publishes a new version after each, as the training binary does, so
the buffer drains and workers swap versions. Registration is rate-limited per client IP;
here every worker shares 127.0.0.1, so the bench raises `register_burst` to the fleet size
(500 machines would come from 500 addresses).

Reported: sustained accepted submissions/s (and groups/s, trajectories/s), p50/p99
client-side latency per endpoint, status counts (0 5xx expected), the time the controller
spends in each operation (the lock serializes them: its busy fraction is the saturation
signal), CPU seconds of the controller, reward pool and client processes, and an audit that
reads the SQLite file independently after the run: every group a client was told was
accepted is in the database exactly once, with its trajectories, no row is there without
an acceptance, and the learner consumed none twice. A table on stdout, everything in
--out as JSON.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sqlite3
import tempfile
import threading
import time

import numpy as np
import psutil

from bench import load_client

OPS = ("register", "authenticate", "heartbeat", "lease", "submit", "leave")


class OpTimer:
    """Wall time per controller operation (wrapping the instance's methods; lock waits
    included), submit's reward scoring (outside the lock) as `score`, and the outermost
    SQLite transactions as `transaction`: those run under the controller's one lock, so
    their busy fraction is how saturated the lock is."""

    def __init__(self, ctl):
        self.total, self.count = collections.Counter(), collections.Counter()
        self._lock = threading.Lock()
        for name in OPS:
            setattr(ctl, name, self._wrap(name, getattr(ctl, name)))
        ctl.scorer.score_group = self._wrap("score", ctl.scorer.score_group)
        store, tx = ctl.db, ctl.db.tx

        @contextlib.contextmanager
        def timed_tx():
            if store.conn.in_transaction:  # nested: timed by the outer one
                with tx():
                    yield
                return
            t0 = time.perf_counter()
            with tx():
                yield
            self.total["transaction"] += time.perf_counter() - t0
            self.count["transaction"] += 1

        store.tx = timed_tx

    def _wrap(self, name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.total[name] += time.perf_counter() - t0
                    self.count[name] += 1

        return timed


def audit(db_path: str, accepted: list, consumed: list, group_size: int) -> dict:
    """Exactly-once, from the SQLite file alone (opened read-only after the controller closed).

    Every acceptance a client was told of ends either as one buffered/consumed row stored
    under the accepting lease, or as one stale drop (the learner's staleness bound requeues
    a buffered group; it may then be leased and accepted again). So, exactly:
    acceptances == rows held + `staleness/dropped`, with no row held that nobody was told of.
    """
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    conn.row_factory = sqlite3.Row
    rows = {
        r["group_id"]: r
        for r in conn.execute(
            "SELECT group_id, prompt_id, state, lease_id, payload, attempts FROM groups"
        )
    }
    kv = {r["key"]: json.loads(r["value"]) for r in conn.execute("SELECT key, value FROM kv")}
    conn.close()
    held = {g: r for g, r in rows.items() if r["state"] in ("buffered", "consumed")}
    told = collections.Counter(gid for gid, *_ in accepted)
    # A group accepted again after a stale drop is stored under the last acceptance in time
    # (the client processes' lists are concatenated, not interleaved: sort by wall time).
    last_lease = {gid: lease for gid, lease, *_ in sorted(accepted, key=lambda a: a[2:])}
    dropped = kv.get("staleness/dropped", 0)
    missing = [g for g in told if g not in rows]
    requeued = [g for g in told if g in rows and g not in held]
    not_told = [g for g in held if g not in told]
    wrong_lease = [g for g in told if g in held and held[g]["lease_id"] != last_lease[g]]
    no_drop = [g for g in told if told[g] - (g in held) > rows.get(g, {"attempts": 0})["attempts"]]
    bad_payload = []
    for g, r in held.items():
        trajs = json.loads(r["payload"]) if r["payload"] else []
        if len(trajs) != group_size or any(t["prompt_id"] != r["prompt_id"] for t in trajs):
            bad_payload.append(g)
    consumed_twice = [g for g, n in collections.Counter(consumed).items() if n > 1]
    problems = [
        f"{len(bad)} groups {name}: {sorted(bad)[:5]}"
        for name, bad in (
            ("accepted but gone from the database", missing),
            ("held in the database but never accepted", not_told),
            ("stored under another lease than the accepting one", wrong_lease),
            ("accepted more often than requeued", no_drop),
            ("held with a payload that is not a complete group of its prompt", bad_payload),
            ("consumed twice by the learner", consumed_twice),
        )
        if bad
    ]
    if len(accepted) != len(held) + dropped:
        problems.append(f"{len(accepted)} acceptances != {len(held)} held + {dropped} dropped")
    if {g for g, r in held.items() if r["state"] == "consumed"} != set(consumed):
        problems.append("the learner's consumed groups differ from the database's")
    if kv.get("groups/accepted", 0) != len(accepted):
        problems.append(f"groups/accepted={kv.get('groups/accepted')} != {len(accepted)} told")
    return {
        "ok": not problems,
        "problems": problems,
        "acceptances": len(accepted),
        "groups_held": len(held),
        "stale_dropped": dropped,
        "requeued_after_accept": len(requeued),
        "consumed": len(consumed),
    }


def run(args: argparse.Namespace) -> dict:
    from bridge.contracts.prompt import TextCodec
    from bridge.control.config import ControllerConfig
    from bridge.control.controller import Controller
    from bridge.control.http.service import ServerOptions, serve_controller
    from bridge.control.protocol import SamplingParams
    from bridge.model import tiny_model
    from bridge.tasks import make_task

    workdir = args.workdir or tempfile.mkdtemp(prefix="echo2_controller_load_")
    tok_dir = os.path.join(workdir, "tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    tiny_model.save_tokenizer(tok_dir)
    codec = TextCodec(tok_dir)
    db_path = os.path.join(workdir, "controller.db")
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(db_path + suffix):
            os.remove(db_path + suffix)
    config = ControllerConfig(
        staleness=args.staleness,
        groups_per_step=args.groups_per_step,
        group_size=args.group_size,
        sampling=SamplingParams(max_tokens=args.max_tokens),
        vocab_size=codec.tok.get_vocab_size(),
        register_burst=max(64, args.workers),  # one IP for the whole simulated fleet
        **({"lease_retry_budget_per_s": args.retry_budget} if args.retry_budget >= 0 else {}),
    )
    if args.kill_at_s > 0:  # the controller in its own process, SIGKILLed mid-run
        from bench import controller_kill

        return controller_kill.run(args, config, workdir, tok_dir, codec, db_path)
    ctl = Controller(config, db_path, make_task("arithmetic"), codec=codec)
    timer = OpTimer(ctl)
    server = serve_controller(ctl, workdir, ServerOptions())
    with open(os.path.join(workdir, "join_token")) as f:
        secret = f.read().strip()
    ctl.publish(0)
    ctl.scorer.pool  # start the reward pool before the clock runs  # noqa: B018

    stop, consumed, steps = threading.Event(), [], [0]

    def learner():
        while not stop.is_set():
            batch, _ = ctl.wait_batch(steps[0], args.groups_per_step, timeout_s=0.5)
            if batch is not None:
                consumed.extend(g.group_id for g in batch)
                steps[0] += 1
                ctl.publish(steps[0])

    cfg = {
        k: getattr(args, k)
        for k in ("workers", "duration_s", "ramp_s", "gen_s", "max_groups", "seed", "timeout_s")
    }
    me = psutil.Process()
    cpu0 = me.cpu_times()
    thread = threading.Thread(target=learner, daemon=True)
    thread.start()
    t0 = time.monotonic()
    # --client_procs processes share the fleet (one asyncio process saturates near 1000).
    procs, outs = load_client.start_client_procs(
        server.url, secret, tok_dir, cfg, args.client_procs, workdir
    )
    pool_cpu = 0.0
    while any(p.is_alive() for p in procs):
        procs[0].join(timeout=1.0)
        for p in procs:
            p.join(timeout=0.0)
        pool_cpu = max(pool_cpu, _children_cpu(me, exclude={p.pid for p in procs}))
    wall = time.monotonic() - t0
    cpu1 = me.cpu_times()
    stop.set()
    thread.join()
    stats = ctl.stats()
    group_commit = ctl.db.group_commit.stats()
    server.stop()
    ctl.close()
    clients = load_client.merge([json.load(open(o)) for o in outs])
    result = summarize(args, clients, timer, stats, wall, steps[0])
    result["group_commit"] = group_commit  # commits per fsync, time on the disk
    result["cpu_s"] = {
        "controller": (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system),
        "reward_pool": pool_cpu,
        "clients": clients["cpu_s"],
        "machine_cores": os.cpu_count(),
        "loadavg_after": os.getloadavg(),
    }
    result["audit"] = audit(db_path, clients["accepted"], consumed, args.group_size)
    return result


def _children_cpu(proc, exclude: set[int]) -> float:
    total = 0.0
    for c in proc.children(recursive=True):
        if c.pid in exclude:
            continue
        try:
            t = c.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def summarize(args, clients, timer, stats, wall_s, steps) -> dict:
    # Sustained rates over the steady window, when every worker has joined.
    window = args.duration_s
    steady = [n for t, n in clients["submitted"] if args.ramp_s <= t <= args.ramp_s + window]
    endpoints = {}
    for ep, lat in clients["latency"].items():
        a = np.asarray(lat) * 1e3
        codes = {k.split()[1]: n for k, n in clients["status"].items() if k.split()[0] == ep}
        endpoints[ep] = {
            "requests": len(a),
            "per_s": len(a) / wall_s,
            "p50_ms": float(np.percentile(a, 50)),
            "p99_ms": float(np.percentile(a, 99)),
            "status": codes,
            "transport_errors": {
                k.split()[1]: n
                for k, n in clients["transport_errors"].items()
                if k.split()[0] == ep
            },
        }
    fivexx = sum(n for k, n in clients["status"].items() if k.split()[1].startswith("5"))
    return {
        "params": vars(args),
        "wall_s": wall_s,
        "registered": clients["registered"],
        "submissions_per_s": len(steady) / window,
        "groups_accepted_per_s": sum(steady) / window,
        "trajectories_per_s": sum(steady) * args.group_size / window,
        "groups_accepted": len(clients["accepted"]),
        "learner_steps": steps,
        "server_5xx": fivexx,
        "transport_errors": sum(clients["transport_errors"].values()),
        "lease_reasons": clients["reasons"],
        "endpoints": endpoints,
        "controller_ops": {
            name: {
                "count": timer.count[name],
                "mean_ms": 1e3 * timer.total[name] / max(1, timer.count[name]),
                "busy_fraction": timer.total[name] / wall_s,
            }
            for name in (*OPS, "score", "transaction")
        },
        "fleet/rate_limited": stats.get("fleet/rate_limited", 0),
        "controller_stats": {k: v for k, v in stats.items() if isinstance(v, int | float)},
    }


def print_table(r: dict) -> None:
    print(
        f"\n{r['registered']} workers, {r['wall_s']:.0f}s: {r['submissions_per_s']:.1f} "
        f"submissions/s, {r['groups_accepted_per_s']:.1f} groups/s, "
        f"{r['trajectories_per_s']:.0f} trajectories/s accepted; {r['learner_steps']} learner "
        f"steps; 5xx: {r['server_5xx']}; transport errors: {r['transport_errors']}; "
        f"rate limited: {r['fleet/rate_limited']}"
    )
    print(f"{'endpoint':<16}{'requests':>10}{'per s':>9}{'p50 ms':>10}{'p99 ms':>10}  status")
    for ep, e in sorted(r["endpoints"].items()):
        print(
            f"{ep:<16}{e['requests']:>10}{e['per_s']:>9.1f}{e['p50_ms']:>10.1f}"
            f"{e['p99_ms']:>10.1f}  {e['status']}"
        )
    print(f"{'controller op':<16}{'count':>10}{'mean ms':>9}{'busy':>10}")
    for name, o in r["controller_ops"].items():
        print(f"{name:<16}{o['count']:>10}{o['mean_ms']:>9.2f}{o['busy_fraction']:>10.2f}")
    print(f"cpu seconds: {r['cpu_s']}")
    print(f"group commit: {r.get('group_commit')}; killed: {r.get('killed')}")
    a = r["audit"]
    print(f"audit: {'OK' if a['ok'] else 'FAILED'} {a}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=500)
    p.add_argument("--duration_s", type=float, default=120.0)
    p.add_argument("--ramp_s", type=float, default=10.0, help="workers join over this time")
    p.add_argument("--gen_s", type=float, default=2.0, help="simulated generation per lease")
    p.add_argument("--max_groups", type=int, default=1, help="groups a worker asks per lease")
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--max_tokens", type=int, default=16)
    p.add_argument("--groups_per_step", type=int, default=256)
    p.add_argument("--staleness", type=int, default=2)
    p.add_argument("--retry_budget", type=float, default=-1.0,
                   help="lease_retry_budget_per_s (refusal_pacing.py); -1: default")  # fmt: skip
    p.add_argument("--timeout_s", type=float, default=60.0, help="client request timeout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default="")
    p.add_argument("--client_procs", type=int, default=0, help="0: one per 700 workers")
    p.add_argument("--sweep", action="store_true", help="bench/controller_sweep.py")
    p.add_argument("--kill_at_s", type=float, default=0.0, help="bench/controller_kill.py")
    p.add_argument("--baseline", default="", help="--sweep: a checkout of the old release")
    p.add_argument("--repeats", type=int, default=1, help="--sweep: runs per arm and tree")
    p.add_argument("--arms", default="", help="--sweep: NAME:WORKERS@GEN_S,... (default all)")
    args = p.parse_args(argv)
    args.client_procs = args.client_procs or max(1, -(-args.workers // 700))
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.sweep:
        from bench import controller_sweep

        return controller_sweep.main(args, argv or [])
    result = run(args)
    print_table(result)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
