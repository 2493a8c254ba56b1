"""Chaos soak: the demo job under a seeded fault schedule, then an independent audit.

    python -m bench.chaos --out=/tmp/chaos.json [--minutes=10] [--seed=0] [--workers=3] \
        [--config=configs/tiny_arith.py] [--workdir=/tmp/echo2_chaos] [--set KEY=VALUE ...] \
        [--faults=worker_kill,...,hostile_workers,hostile_peer] [--no-baseline] [--sft_from=DIR]

One SFT warm start runs first (bench/arms.py); the soak and the fault-free baseline each
start from a copy. The training binary runs with `local_workers=0` on a fixed controller
port; the bench runs `--workers` `python -m rollout_gpu.worker` processes itself (joined
with `<workdir>/join_token`, relay off so every worker reads the store, unless fault
`hostile_peer` makes the broadcast a relay chain: bench/chaos_peer.py), restarting any
that exits (bench/chaos_soak.py). Faults, at seeded times within `--minutes`: kill -9 of a
worker (restarted), kill -9 of the binary twice (rerun with the same workdir: it resumes
from its checkpoint), a graceful restart (SIGINT, rerun: the controller restarts between
steps), a worker stopped with SIGSTOP while it holds a lease, past the lease TTL, then
continued, flipped bytes in a chunk of `--corrupt_versions` freshly published versions
(bench/chaos_faults.py; the workers report a version they cannot load and the learner
publishes it again: learner_jax/rl/heal.py), and a hostile client posting forged
submissions.

At the end the binary gets SIGINT; the audit (bench/chaos_audit.py) reads the bench's own
observations of controller.db (dumped to `<workdir>/soak/chaos_observations.json`), the
event log (`<workdir>/soak/chaos_events.jsonl`), the worker logs and metrics.jsonl, and
checks that no gap between RL steps outlasts the bound the faults allow (bench/chaos_stall.py:
its answer in the JSON holds its inputs, `python -m bench.chaos_stall F.json` recomputes it). The
baseline runs the same number of RL steps without faults; held-out accuracies must agree
within 5 points. Prints the fault table and the audit; writes everything as JSON to --out.
Exit status 1 if the audit fails.

`--netns` (root; bench/netbed.py) runs the soak on real kernel links: the binary in a
learner namespace (uplink --learner_mbps), each worker in its own (uplink --worker_mbps,
its relay on its own address), joined by a bridge; `--relay_chain` makes the broadcast a
relay chain. It adds the network faults (the default faults there: all of the above, plus
these): `net_slow` (one worker's uplink 10x slower, to the end), `net_partition` (a worker's
link cut for 20 s while its relay holds part of a version, or, without a relay chain, while
it holds a lease), `net_flap` (the learner's uplink down 3 x 2 s). The weight store stays
a local directory; `hostile_peer`'s relay runs in the bench's process and listens on the
root namespace's address on the testbed's bridge (unshaped), where the workers and the
controller reach it like any peer's relay.
The 30-minute soak in the testbed (every fault, the network faults included):

    python -m bench.chaos --netns --relay_chain --minutes=30 --no-baseline \
        --out=/tmp/chaos_netns30.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import threading
import time

from bench import arms, chaos_audit, chaos_hostile, chaos_peer, chaos_stall, exact_log, netbed
from bench.chaos_soak import Soak

LEASE_TTL_S = 60.0  # bridge/control/controller.py ControllerConfig.lease_ttl_s
ALL_FAULTS = (
    "worker_kill",
    "binary_kill",
    "binary_restart",
    "sigstop",
    "corrupt",
    "garbage",
    "hostile_workers",
    "hostile_peer",
)
NET_FAULTS = ("net_partition", "net_flap", "net_slow")  # --netns only (bench/netbed.py)


def schedule(faults: list[str], seconds: float, rng: random.Random) -> list[tuple[float, str]]:
    """Seeded fault times: the binary faults spread out, the rest jittered between them."""
    plan = []
    j = lambda lo, hi: seconds * rng.uniform(lo, hi)  # noqa: E731
    if "hostile_workers" in faults:  # they stay for the whole soak (bench/chaos_hostile.py)
        plan.append((j(0.0, 0.02), "hostile_workers"))
    if "hostile_peer" in faults:  # a corrupting relay, for the whole soak (bench/chaos_peer.py)
        plan.append((j(0.0, 0.02), "hostile_peer"))
    if "sigstop" in faults:
        plan.append((j(0.02, 0.06), "sigstop"))
    if "binary_kill" in faults:
        plan += [(j(0.22, 0.28), "binary_kill"), (j(0.72, 0.78), "binary_kill")]
    if "corrupt" in faults:
        plan.append((j(0.32, 0.38), "corrupt"))
    if "binary_restart" in faults:
        plan.append((j(0.47, 0.53), "binary_restart"))
    if "garbage" in faults:
        plan.append((j(0.58, 0.66), "garbage"))
    if "worker_kill" in faults:
        plan += [(j(lo, lo + 0.08), "worker_kill") for lo in (0.12, 0.40, 0.82)]
    if "net_slow" in faults:  # stays slowed to the end
        plan.append((j(0.06, 0.10), "net_slow"))
    if "net_partition" in faults:
        plan.append((j(0.64, 0.70), "net_partition"))
    if "net_flap" in faults:
        plan.append((j(0.88, 0.94), "net_flap"))
    return sorted(plan)


def vocab_size(workdir: str) -> int:
    with open(os.path.join(workdir, "model", "config.json")) as f:
        return json.load(f)["vocab_size"]


def soak(config, base, workdir, overrides, n_workers, seconds, faults, seed, corrupt_count,
         net=None) -> dict:  # fmt: skip
    """`net`: (learner MB/s, worker MB/s, relay chain?) to run in a testbed (bench/netbed.py)."""
    wd = os.path.join(workdir, "soak")
    shutil.copytree(base, wd)
    bed = None
    if net is not None:
        learner_mbps, worker_mbps, _ = net
        hosts = {"learner": learner_mbps, **{f"w{i}": worker_mbps for i in range(n_workers)}}
        bed = netbed.Netbed(hosts).__enter__()
    relay = "hostile_peer" in faults or (net is not None and net[2])
    s = Soak(config, wd, overrides, n_workers, relay=relay, bed=bed)
    try:
        return _soak(s, wd, n_workers, seconds, faults, seed, corrupt_count)
    finally:
        s.kill_everything()
        if bed is not None:
            bed.close()


def _soak(s: Soak, wd: str, n_workers, seconds, faults, seed, corrupt_count) -> dict:
    rng = random.Random(seed)
    plan = schedule(faults, seconds, rng)
    print("fault schedule: " + ", ".join(f"{t:.0f}s {f}" for t, f in plan), flush=True)
    s.start_binary()
    threading.Thread(target=s.supervisor, daemon=True).start()
    s.obs.start()
    if not s.wait_serving(900):
        s.stop_all()
        raise RuntimeError(f"the soak never trained; see {wd}/binary-0.log")
    s.t0 = time.time()
    s.event("start", "learner", f"training; {n_workers} workers")
    corrupt, hostile, hostile_workers, peer, ran = [], [], [], None, []
    for at, fault in plan:
        time.sleep(max(0.0, at - (time.time() - s.t0)))
        if s.binary.poll() is not None:
            s.event(fault, "learner", f"binary exited {s.binary.returncode}: stop")
            break
        ran.append((time.time(), fault))
        if fault == "worker_kill":
            s.kill_worker(rng)
        elif fault == "binary_kill":
            s.kill_binary()
        elif fault == "binary_restart":
            s.restart_binary()
        elif fault == "sigstop":
            threading.Thread(target=s.sigstop, args=(rng, LEASE_TTL_S + 15), daemon=True).start()
        elif fault == "corrupt":
            corrupt += s.corrupt(corrupt_count)
        elif fault == "garbage":
            hostile.append(s.garbage(vocab_size(wd)))
        elif fault == "hostile_workers":
            with open(os.path.join(wd, "join_token")) as f:
                secret = f.read().strip()
            # In a testbed every attacker calls from one address: a credential each
            hostile_workers = chaos_hostile.start(
                s.url, secret, wd, seed=seed, credentials=s.bed is not None
            )
            s.event("hostile_workers", "fleet", ", ".join(chaos_hostile.CLASSES))
        elif fault == "net_partition":
            part = (rng, chaos_stall.NET_PARTITION_S)
            threading.Thread(target=s.net_partition, args=part, daemon=True).start()
        elif fault == "net_flap":
            threading.Thread(target=s.net_flap, args=chaos_stall.NET_FLAP, daemon=True).start()
        elif fault == "net_slow":
            s.net_slow(rng, chaos_stall.NET_SLOW_FACTOR)
        elif fault == "hostile_peer":
            with open(os.path.join(wd, "join_token")) as f:
                host = s.bed.root_ip if s.bed is not None else "127.0.0.1"
                peer = chaos_peer.start(s.url, f.read().strip(), host=host)
            s.event("hostile_peer", "fleet", "corrupting relay that lies about its parent")
    time.sleep(max(0.0, seconds - (time.time() - s.t0)))
    hostile_results = [w.stop() for w in hostile_workers]
    peer_result = peer.stop() if peer is not None else None
    if peer_result:
        p = peer_result
        s.event("hostile_peer", ",".join(p["worker_ids"]) or "?",
                f"served {p['tampered_chunks']} altered chunks over {p['tampering_s']} s, "
                f"{p['false_reports']} false reports")  # fmt: skip
    for r in hostile_results:
        s.event(f"hostile_{r['class']}", r["worker_id"] or "?",
                f"statuses {r['statuses']}, accepted {r['accepted_groups']} groups, "
                f"quarantined {r['quarantined']}")  # fmt: skip
    s.supervise = False
    end_at = time.time()
    s.binary.send_signal(signal.SIGINT)
    rc = s.binary.wait(timeout=600)
    s.event("end", "learner", f"SIGINT -> exit {rc}")
    s.stop_all()
    s.obs.stop()
    cfg = json.load(open(os.path.join(wd, "config.json")))
    resumes = {r: s.resumed_from(r) for r in range(1, s.runs)}
    result = chaos_audit.audit(
        s.obs,
        wd,
        s.wlogs,
        cfg["staleness"],
        cfg["batch"]["groups_per_step"],
        {r: v for r, v in resumes.items() if v is not None},
        corrupt,
        {h["worker_id"] for h in hostile if h.get("worker_id")},
        s.run_starts,
        forgers={r["worker_id"] for r in hostile_results if r["worker_id"]},
    )
    # 6. No honest worker quarantined; no group a hostile worker chose trained (judged on
    # the learner's exact-check record of every run: bench/chaos_hostile.py `verdict`).
    garbage = [{"class": "garbage", "worker_id": h["worker_id"], "accepted_groups": 0}
               for h in hostile if h.get("worker_id")]  # fmt: skip
    quarantined = {w for _, w in s.obs.quarantined}
    result["checks"]["quarantine"] = chaos_hostile.verdict(
        hostile_results + garbage, quarantined, exact_log.every_check(wd)
    )
    if peer_result is not None:  # 7. A corrupting relay poisons no one and is excluded.
        with open(os.path.join(wd, "metrics.jsonl")) as f:
            rows = [json.loads(x) for x in f]
        lines = []
        for i in range(n_workers):
            with open(os.path.join(s.wlogs, f"worker-{i}.log"), errors="replace") as f:
                lines += f.readlines()
        result["checks"]["hostile_peer"] = chaos_peer.verdict(peer_result, rows, lines)
    with open(os.path.join(wd, "metrics.jsonl")) as f:
        walls = [r["time/wall"] for r in map(json.loads, f) if "time/wall" in r]
    # 8. No stall longer than B (bench/chaos_stall.py), B from the faults that ran.
    startup_s = s.t0 - s.run_starts[0]
    result["checks"]["no_stall"] = chaos_stall.check(
        walls, ran, end_at, LEASE_TTL_S, startup_s, corrupt_count
    )
    result["ok"] = all(c["ok"] for c in result["checks"].values())
    for rec in corrupt:
        rec.pop("manifest", None)
    s.obs.dump(os.path.join(wd, "chaos_observations.json"))
    return {
        "workdir": wd,
        "t0": s.t0,  # the events' `t` are seconds after it
        "fault_schedule": [{"planned_s": round(t, 1), "fault": f} for t, f in plan],
        "events": s.events,
        "audit": result,
        "corrupt": corrupt,
        "hostile": hostile,
        "hostile_workers": hostile_results,
        "binary_runs": s.runs,
        "final_exit": rc,
        "rl_steps": s.rl_rows(),
        "accuracy": final_accuracy(wd),
    }


def final_accuracy(workdir: str) -> float | None:
    path = os.path.join(workdir, "eval.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        rows = [json.loads(x) for x in f]
    rows = [r for r in rows if r.get("tag") != "before"]
    return max(rows, key=lambda r: r["step"])["accuracy"] if rows else None


def baseline(config, base, workdir, overrides, n_workers, rl_steps) -> dict:
    """The same binary and workers without faults, stopped after `rl_steps` RL steps."""
    wd = os.path.join(workdir, "baseline")
    shutil.copytree(base, wd)
    s = Soak(config, wd, overrides, n_workers)
    try:
        return _baseline(s, wd, rl_steps)
    finally:
        s.kill_everything()


def _baseline(s: Soak, wd: str, rl_steps: int) -> dict:
    s.start_binary()
    threading.Thread(target=s.supervisor, daemon=True).start()
    while s.binary.poll() is None and s.rl_rows() < rl_steps:
        time.sleep(1.0)
    s.supervise = False
    if s.binary.poll() is None:
        s.binary.send_signal(signal.SIGINT)
    rc = s.binary.wait(timeout=600)
    s.stop_all()
    return {"workdir": wd, "exit": rc, "rl_steps": s.rl_rows(), "accuracy": final_accuracy(wd)}


def print_report(r: dict) -> None:
    print(f"\n{'time':>8}  {'fault':<15} {'target':<12} outcome")
    for e in r["soak"]["events"]:
        print(f"{e['t']:>7.1f}s  {e['fault']:<15} {e['target']:<12} {e['outcome']}")
    print("\naudit:")
    for name, c in r["soak"]["audit"]["checks"].items():
        shown = {k: v for k, v in c.items() if k not in ("ok", "inputs")}  # inputs: in the JSON
        detail = {k: v for k, v in shown.items() if v not in ([], {}, None)}
        print(f"  {'PASS' if c['ok'] else 'FAIL'} {name}: {json.dumps(detail)[:600]}")
    print(f"  {'PASS' if r['accuracy_ok'] else 'FAIL'} accuracy: {json.dumps(r['accuracy'])}")
    print(f"overall: {'PASS' if r['ok'] else 'FAIL'}")


def run(
    out,
    minutes=10.0,
    seed=0,
    workers=3,
    config="configs/tiny_arith.py",
    workdir="/tmp/echo2_chaos",
    overrides=(),
    faults=ALL_FAULTS,
    with_baseline=True,
    corrupt_count=2,
    sft_from=None,
    net=None,
) -> dict:
    overrides = ["total_steps=100000", "checkpoint.interval=5", *overrides]
    sft = [o for o in overrides if not o.startswith("total_steps=")]
    if sft_from:  # an earlier run's warm start of the same config (saves its ~8 min here)
        if os.path.abspath(sft_from).startswith(os.path.abspath(workdir) + os.sep):
            raise ValueError(f"--sft_from={sft_from} is inside --workdir, which is wiped")
        shutil.rmtree(workdir, ignore_errors=True)
        base = shutil.copytree(sft_from, os.path.join(workdir, "sft"))
    else:
        base = arms.warm_start(config, workdir, sft)
    soaked = soak(
        config, base, workdir, overrides, workers, minutes * 60, list(faults), seed, corrupt_count,
        net,
    )  # fmt: skip
    acc = {"soak": soaked["accuracy"], "reference": "none"}
    ok_acc = True
    if with_baseline:
        b = baseline(config, base, workdir, overrides, workers, soaked["rl_steps"])
        acc.update(baseline=b["accuracy"], baseline_rl_steps=b["rl_steps"], reference="baseline")
        ok_acc = (
            soaked["accuracy"] is not None
            and b["accuracy"] is not None
            and abs(soaked["accuracy"] - b["accuracy"]) <= 0.05
        )
    acc["soak_rl_steps"] = soaked["rl_steps"]
    r = {
        "soak": soaked,
        "accuracy": acc,
        "accuracy_ok": ok_acc,
        "ok": soaked["audit"]["ok"] and ok_acc,
        "config": {
            "config": config,
            "overrides": list(overrides),
            "minutes": minutes,
            "seed": seed,
            "workers": workers,
            "faults": list(faults),
            "netns": None
            if net is None
            else dict(zip(("learner_mbps", "worker_mbps", "relay_chain"), net, strict=True)),
        },
    }
    print_report(r)
    with open(out, "w") as f:
        json.dump(r, f, indent=2, default=str)
    print(f"wrote {out}")
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--config", default="configs/tiny_arith.py")
    p.add_argument("--workdir", default="/tmp/echo2_chaos")
    p.add_argument("--set", nargs="*", default=[], help="extra KEY=VALUE config overrides")
    p.add_argument("--faults", default="", help="default: all (the network faults with --netns)")
    p.add_argument("--corrupt_versions", type=int, default=2, help="consecutive versions")
    p.add_argument("--no-baseline", dest="baseline", action="store_false")
    p.add_argument("--sft_from", default="", help="copy this warm start instead of training")
    p.add_argument(
        "--netns",
        action="store_true",
        help="the binary and each worker in its own network namespace (root)",
    )
    p.add_argument("--learner_mbps", type=float, default=8.0, help="--netns: learner uplink")
    p.add_argument("--worker_mbps", type=float, default=8.0, help="--netns: worker uplinks")
    p.add_argument(
        "--relay_chain",
        action="store_true",
        help="--netns: workers relay chunks to each other (bridge.broadcast=chain)",
    )
    a = p.parse_args()
    faults = a.faults.split(",") if a.faults else list(ALL_FAULTS)
    if a.netns and not a.faults:
        faults += list(NET_FAULTS)
    if a.netns and (reason := netbed.unavailable()):
        raise SystemExit(f"--netns: {reason}")
    if not a.netns and set(faults) & set(NET_FAULTS):
        raise SystemExit(f"faults {sorted(set(faults) & set(NET_FAULTS))} need --netns")
    r = run(
        a.out,
        a.minutes,
        a.seed,
        a.workers,
        a.config,
        a.workdir,
        a.set,
        faults,
        a.baseline,
        a.corrupt_versions,
        a.sft_from,
        (a.learner_mbps, a.worker_mbps, a.relay_chain) if a.netns else None,
    )
    sys.exit(0 if r["ok"] else 1)


if __name__ == "__main__":
    main()
