"""Heartbeat latency while maximum-size submissions are parsed, through real HTTP on loopback.

    python -m bench.body_parse --out=F.json [--body_mib=15.5 --submitters=3 --rounds=4]

A controller (SQLite file, the tiny tokenizer) served by uvicorn in this process, with its
default body limit. One client subprocess sends a heartbeat every `--pace_ms` and times
each; first alone (idle), then while another client subprocess runs `--submitters` threads,
each posting `--rounds` submissions of `--body_mib` MiB (schema-valid JSON: token ids,
log-probs and versions, so the whole body is parsed and validated, in a parser process;
the lease id is unknown, so the server refuses it (404) before it builds the submission's
Python objects, and nothing else is done with it). One such submission goes first,
unmeasured: the server's parser processes start at the first large body. The headline is
the heartbeats' p99 during the submissions over its idle value (`heartbeat_p99_ratio`; the
bar is 5); the rows are each phase's latency percentiles and the server process's CPU
(`server_cpu_ms_per_submission`: what a body costs the server beyond the heartbeats, the
parsers' CPU not included). The machine's load average is reported: latencies are wall
time, and on a machine with fewer idle cores than the parsers and clients need they
include waiting for a CPU; the server's CPU per submission does not.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# Heartbeats until told to stop (a file appears), latencies (ms) to a JSON file.
_HEARTBEATS = r"""
import json, os, sys, time, httpx
url, token, pace, stop, out, n_min = sys.argv[1:7]
pace, n_min = float(pace) / 1000.0, int(n_min)
lat = []
with httpx.Client(base_url=url, timeout=60) as c:
    auth = {"Authorization": "Bearer " + token}
    while len(lat) < n_min or not os.path.exists(stop):
        t = time.perf_counter()
        r = c.post("/v1/heartbeat", json={"worker_version": 0}, headers=auth)
        lat.append((time.perf_counter() - t) * 1000.0)
        assert r.status_code == 200, r.text
        time.sleep(max(0.0, pace - (time.perf_counter() - t)))
json.dump(lat, open(out, "w"))
"""

# `threads` submitters, `rounds` posts each of the body in a file; statuses to stdout.
_SUBMITTERS = r"""
import json, sys, threading, httpx
url, token, body_file, threads, rounds = sys.argv[1:6]
body = open(body_file, "rb").read()
codes = []
def run():
    with httpx.Client(base_url=url, timeout=600) as c:
        h = {"Authorization": "Bearer " + token, "Content-Type": "application/json"}
        for _ in range(int(rounds)):
            codes.append(c.post("/v1/submit", content=body, headers=h).status_code)
ts = [threading.Thread(target=run) for _ in range(int(threads))]
[t.start() for t in ts]
[t.join() for t in ts]
print(json.dumps(codes))
"""


def submission_body(mib: float) -> bytes:
    """A schema-valid submission of about `mib` MiB: trajectories of 16,384 tokens."""
    tokens = 16384
    traj = {
        "prompt_id": "p",
        "sample_index": 0,
        "prompt_token_ids": [1, 2, 3],
        "completion_token_ids": [151643 - (i % 1000) for i in range(tokens)],
        "logprobs": [-1.2345678 - (i % 97) * 1e-3 for i in range(tokens)],
        "versions": [0] * tokens,
        "finish_reason": "length",
    }
    one = len(json.dumps(traj, separators=(",", ":")))
    n = max(1, int(mib * (1 << 20)) // (one + 2))
    trajs = [dict(traj, sample_index=i) for i in range(n)]
    sub = {"lease_id": "no-such-lease", "groups": [{"group_id": 0, "trajectories": trajs}]}
    return json.dumps(sub, separators=(",", ":")).encode()


def percentiles(lat: list[float]) -> dict:
    s = sorted(lat)

    def q(p: float) -> float:
        return round(s[min(len(s) - 1, int(p * len(s)))], 3)

    return {"n": len(s), "p50_ms": q(0.5), "p99_ms": q(0.99), "max_ms": round(s[-1], 3)}


def _client(script: str, *args) -> list[str]:
    return [sys.executable, "-c", script, *map(str, args)]


def run(args) -> dict:
    from bridge.contracts.prompt import TextCodec
    from bridge.control.config import ControllerConfig
    from bridge.control.controller import Controller
    from bridge.control.http.service import ServerOptions, serve_controller
    from bridge.control.protocol import SamplingParams, WorkerProfile
    from bridge.model import tiny_model
    from bridge.tasks import make_task

    with tempfile.TemporaryDirectory() as tmp:
        os.mkdir(os.path.join(tmp, "tok"))
        tiny_model.save_tokenizer(os.path.join(tmp, "tok"))
        cfg = ControllerConfig(
            staleness=1, groups_per_step=2, group_size=2, vocab_size=100,
            sampling=SamplingParams(max_tokens=4),
            rate_limit_per_s=0.0,  # one client heartbeats every pace_ms
        )  # fmt: skip
        ctl = Controller(
            cfg,
            os.path.join(tmp, "controller.db"),
            make_task("arithmetic"),
            codec=TextCodec(os.path.join(tmp, "tok")),
        )
        server = serve_controller(ctl, tmp, ServerOptions())
        profile = WorkerProfile(accelerator="cpu", price_per_hour=1.0, max_concurrent_sequences=8)
        (_, hb_token), (_, sub_token) = ctl.register(profile), ctl.register(profile)
        body_file = os.path.join(tmp, "body.json")
        body = submission_body(args.body_mib)
        with open(body_file, "wb") as f:
            f.write(body)
        rows = []
        try:
            # One submission first: the parser processes start at the first large body.
            subprocess.run(
                _client(_SUBMITTERS, server.url, sub_token, body_file, 1, 1),
                capture_output=True, check=True, timeout=600,
            )  # fmt: skip
            for phase in ("idle", "submissions"):
                stop, out = os.path.join(tmp, f"stop-{phase}"), os.path.join(tmp, f"{phase}.json")
                hb = subprocess.Popen(
                    _client(
                        _HEARTBEATS, server.url, hb_token, args.pace_ms, stop, out,
                        args.idle_heartbeats if phase == "idle" else 1,
                    )
                )  # fmt: skip
                codes: list[int] = []
                t0, cpu0 = time.monotonic(), time.process_time()
                if phase == "submissions":
                    sub = subprocess.run(
                        _client(
                            _SUBMITTERS, server.url, sub_token, body_file, args.submitters,
                            args.rounds,
                        ),
                        capture_output=True, text=True, check=True, timeout=1800,
                    )  # fmt: skip
                    codes = json.loads(sub.stdout)
                open(stop, "w").close()
                assert hb.wait(timeout=600) == 0, "heartbeat client failed"
                with open(out) as f:
                    lat = json.load(f)
                row = {"phase": phase, **percentiles(lat), "wall_s": time.monotonic() - t0}
                row["server_cpu_s"] = time.process_time() - cpu0
                if codes:
                    row["submit_status"] = sorted(set(codes))
                    row["submissions"] = len(codes)
                    # The server's own CPU (this process: event loop and pool threads, not
                    # the parser processes) per submission, over what heartbeats alone
                    # cost (the idle phase's rate): the GIL-bound work a body costs, which
                    # unlike wall-time latencies does not grow with others' load.
                    idle = rows[0]["server_cpu_s"] / rows[0]["wall_s"]
                    extra = row["server_cpu_s"] - idle * row["wall_s"]
                    row["server_cpu_ms_per_submission"] = round(1000 * extra / len(codes), 2)
                rows.append(row)
        finally:
            server.stop()
            ctl.close()
    idle, busy = rows
    return {
        "headline": {
            "heartbeat_p99_ms_idle": idle["p99_ms"],
            "heartbeat_p99_ms_submissions": busy["p99_ms"],
            "heartbeat_p99_ratio": round(busy["p99_ms"] / max(idle["p99_ms"], 1e-9), 3),
            "body_bytes": len(body),
        },
        "rows": rows,
        "load_average": os.getloadavg(),
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--body_mib", type=float, default=15.5, help="each submission's size")
    p.add_argument("--submitters", type=int, default=3, help="concurrent submissions")
    p.add_argument("--rounds", type=int, default=4, help="submissions per submitter")
    p.add_argument("--pace_ms", type=float, default=10.0, help="between heartbeats")
    p.add_argument("--idle_heartbeats", type=int, default=300, help="in the idle phase")
    args = p.parse_args(argv)
    result = run(args)
    print(f"{'phase':12s} {'n':>5s} {'p50 ms':>8s} {'p99 ms':>8s} {'max ms':>8s}")
    for r in result["rows"]:
        print(
            f"{r['phase']:12s} {r['n']:5d} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['max_ms']:8.2f}"
        )
    print(f"server CPU per submission {result['rows'][1]['server_cpu_ms_per_submission']} ms")
    print(json.dumps(result["headline"]))
    print(f"load average {result['load_average']}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
