"""Controller CPU per request, per hot endpoint, through real HTTP on loopback (issue 25).

    python -m bench.controller_cpu --out=F.json [--baseline=DIR --workers=100 --requests=2000]

A controller (SQLite file, the tiny tokenizer) served by uvicorn in this process; a client
subprocess (8 threads, keep-alive connections) sends `--requests` heartbeats, then as many
lease requests, from `--workers` registered workers, `--rounds` times. The lease requests are
mostly refused ("full": the admission cap is reached after the first few hundred groups), so
they measure the lease path without a grant. Then `--requests` work cycles ("cycle"): each a
lease request that is granted and the submission of its group (8 completions, scored in the
reward pool), with a learner thread in the server process taking batches and publishing, as
the training binary does: the CPU per accepted submission at the fleet's steady state, lease,
submission, fsync and the learner's share included. The server process's CPU (getrusage,
reward pool processes excluded) over each phase divided by the requests is the CPU per
request; the median over rounds is reported.
`--baseline=DIR` (a checkout of the previous release, e.g. `git worktree add --detach DIR
REV`) runs the same measurement on that code, in a fresh process, and reports new/baseline;
`--lean_routes=false` turns the lean handlers off (bridge/control/http/fast_routes.py). The
machine's load average is reported: CPU time is less sensitive to a shared machine than
wall time, not immune (caches, frequency).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading

_CLIENT = r"""
import json, sys, threading, httpx
url, n, path, tokens = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.load(open(sys.argv[4]))
body = {"worker_version": 0, "samples_per_s": 1.0}
if path == "/v1/lease":
    body = {"worker_version": 0, "max_groups": 1}
def run(k):
    with httpx.Client(base_url=url, timeout=60) as c:
        for i in range(k, n, 8):
            auth = {"Authorization": "Bearer " + tokens[i % len(tokens)]}
            r = c.post(path, json=body, headers=auth)
            assert r.status_code == 200, r.text
refused = [0]
def cycles(k):  # lease, then submit what was granted; refusals are asked again
    with httpx.Client(base_url=url, timeout=60) as c:
        version, done, i = 0, 0, k
        while done < len(range(k, n, 8)):
            auth = {"Authorization": "Bearer " + tokens[i % len(tokens)]}
            i += 8
            r = c.post("/v1/lease", json={"worker_version": version, "max_groups": 1}, headers=auth)
            assert r.status_code == 200, r.text
            reply = r.json()
            refused[0] += reply["lease"] is None
            version = reply["swap_to"] if reply["swap_to"] is not None else version
            if reply["lease"] is None:
                continue
            groups = [{"group_id": g["group_id"], "trajectories": [{
                "prompt_id": g["prompt_id"], "sample_index": j,
                "prompt_token_ids": g["prompt_token_ids"], "completion_token_ids": [12, 13, 2],
                "logprobs": [-0.1, -2.0, -0.3], "versions": [version] * 3,
                "finish_reason": "stop"} for j in range(g["n"])]} for g in reply["lease"]["groups"]]
            body = {"lease_id": reply["lease"]["lease_id"], "groups": groups}
            r = c.post("/v1/submit", json=body, headers=auth)
            assert r.status_code == 200 and r.json()["accepted"], r.text
            done += 1
if path == "cycle":
    run = cycles
threads = [threading.Thread(target=run, args=(k,)) for k in range(8)]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps({"refused": refused[0]}))
"""
PATHS = ("/v1/heartbeat", "/v1/lease", "cycle")


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(workers: int, requests: int, rounds: int, lean: bool) -> dict:
    import httpx

    from bridge.contracts.prompt import TextCodec
    from bridge.control.config import ControllerConfig
    from bridge.control.controller import Controller
    from bridge.control.http.service import (
        ServerOptions,
        load_or_create_join_secret,
        serve_controller,
    )
    from bridge.control.protocol import SamplingParams
    from bridge.model import tiny_model
    from bridge.tasks import make_task

    workdir = tempfile.mkdtemp(prefix="controller_cpu_")
    tok = os.path.join(workdir, "tokenizer")
    os.mkdir(tok)
    tiny_model.save_tokenizer(tok)
    cfg = ControllerConfig(
        vocab_size=100, group_size=8, groups_per_step=64, sampling=SamplingParams(max_tokens=4),
        rate_limit_per_s=0.0, register_burst=float(workers + 10),
    )  # fmt: skip
    ctl = Controller(
        cfg, os.path.join(workdir, "c.db"), make_task("arithmetic"), codec=TextCodec(tok)
    )
    ctl.publish(0, {"driver": "memory"})
    lean_opt = {"lean_routes": lean} if hasattr(ServerOptions, "lean_routes") else {}
    server = serve_controller(ctl, workdir, ServerOptions(**lean_opt))
    secret = load_or_create_join_secret(workdir)
    profile = {"accelerator": "cpu", "price_per_hour": 0.5, "max_concurrent_sequences": 16}
    with httpx.Client(base_url=server.url, timeout=60) as c:
        tokens = [
            c.post("/v1/register", json={"join_secret": secret, "profile": profile}).json()["token"]
            for _ in range(workers)
        ]
    token_file = os.path.join(workdir, "tokens.json")
    with open(token_file, "w") as f:
        json.dump(tokens, f)
    ms, refused = {p: [] for p in PATHS}, []
    stop = threading.Event()

    def learner():  # takes batches and publishes, so the "cycle" phase's leases are granted
        step = 0
        while not stop.is_set():
            batch, _ = ctl.wait_batch(step, cfg.groups_per_step, timeout_s=0.5)
            if batch is not None:
                step += 1
                ctl.publish(step, {"driver": "memory"})

    thread = threading.Thread(target=learner, daemon=True)
    thread.start()
    ctl.scorer.pool  # the reward pool started before the clock runs  # noqa: B018
    try:
        # The work cycles first: the lease phase's grants are never submitted, they hold
        # the admission until they expire.
        for path in ("cycle", *PATHS[:-1]) if "cycle" in PATHS and len(PATHS) > 1 else PATHS:
            for _ in range(rounds):
                before = _cpu_s()
                cmd = [sys.executable, "-c", _CLIENT, server.url, str(requests), path, token_file]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                ms[path].append(1000.0 * (_cpu_s() - before) / requests)
                if path == "cycle":  # refused leases asked again: part of the cycles' CPU
                    refused.append(json.loads(out.strip().splitlines()[-1])["refused"])
    finally:
        stop.set()
        thread.join()
        server.stop()
        ctl.close()
    return {
        "cpu_ms_per_request": {p: statistics.median(v) for p, v in ms.items()},
        "rounds_ms": ms,
        "cycle_refusals": refused,
        "lean_routes": lean_opt.get("lean_routes"),
        "loadavg": os.getloadavg(),
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=100)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lean_routes", default="true", choices=("true", "false"))
    p.add_argument("--baseline", default="", help="a checkout of the previous release")
    p.add_argument("--_raw", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    new = measure(a.workers, a.requests, a.rounds, a.lean_routes == "true")
    if a._raw:  # the baseline's measurement, for the parent process
        print(json.dumps(new))
        return new
    result = {"new": new}
    if a.baseline:
        cmd = [sys.executable, os.path.abspath(__file__), "--out=-", "--_raw"]
        cmd += [f"--workers={a.workers}", f"--requests={a.requests}", f"--rounds={a.rounds}"]
        env = {**os.environ, "PYTHONPATH": os.path.abspath(a.baseline)}
        out = subprocess.run(cmd, cwd=a.baseline, env=env, capture_output=True, text=True)
        if out.returncode:
            raise RuntimeError(f"baseline run failed: {out.stderr[-2000:]}")
        base = json.loads(out.stdout.strip().splitlines()[-1])
        result["baseline"] = base
        result["ratio_new_over_baseline"] = {
            path: new["cpu_ms_per_request"][path] / base["cpu_ms_per_request"][path]
            for path in PATHS
        }
    for name in ("baseline", "new"):
        if name in result:
            cpu = result[name]["cpu_ms_per_request"]
            print(f"{name:9s} " + "  ".join(f"{p} {cpu[p]:.3f} ms" for p in PATHS))
    if "ratio_new_over_baseline" in result:
        print("new/baseline " + json.dumps(result["ratio_new_over_baseline"]))
    print(f"load average {os.getloadavg()}")
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
