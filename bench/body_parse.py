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

`--leased_trajectories=64`: valid submissions instead (64 trajectories of 16,384 tokens
the reward can see, 15.4 MiB), each for its own lease, held by the submitter (leased in
this process before the phases), so each is checked, scored in the reward pool and accepted
(200): the whole submit path. The headline then describes that run, and
`leased_submissions` adds the heartbeats' p50/p99 idle and during, their p99 ratio
(`heartbeat_p99_ratio_leased`) and the CPU each `Controller.submit` call cost its thread
(`time.thread_time`; the unmeasured first one, which starts the reward pool, apart).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# A maximum-length completion: with `--leased_trajectories=64`, a 16.4 MiB submission.
_LEASED_TOKENS = 16384
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

# `threads` submitters, `rounds` posts each, of the bodies in the files a JSON list names
# (taken in turn: one file per post where each needs its own lease); statuses to stdout.
_SUBMITTERS = r"""
import json, sys, threading, httpx
url, token, files_json, threads, rounds = sys.argv[1:6]
files, lock = json.load(open(files_json)), threading.Lock()
codes = []
def run():
    with httpx.Client(base_url=url, timeout=600) as c:
        h = {"Authorization": "Bearer " + token, "Content-Type": "application/json"}
        for _ in range(int(rounds)):
            with lock:
                body = open(files.pop(0), "rb").read()
            r = c.post("/v1/submit", content=body, headers=h)
            codes.append(r.status_code)
            if r.status_code != 200:
                print(r.status_code, r.text[:300], file=sys.stderr)
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


def leased_body(lease, visible: list[int], tokens: int) -> bytes:
    """A valid submission for `lease` (one group): each trajectory `tokens` completion ids
    the reward can see, from the leased prompt, so the whole submit path runs (the checks,
    the scoring, the acceptance)."""
    (group,) = lease.groups
    trajs = [
        {
            "prompt_id": group.prompt_id,
            "sample_index": k,
            "prompt_token_ids": list(group.prompt_token_ids),
            "completion_token_ids": [visible[(i * 7 + k) % len(visible)] for i in range(tokens)],
            # 6 or 7 decimals: ~15.5 bytes a token, the largest body under the 16 MiB limit
            "logprobs": [round(-1.2345678 - (i % 97) * 1e-3, 6 + i % 2) for i in range(tokens)],
            "versions": [0] * tokens,
            "finish_reason": "length",
        }
        for k in range(group.n)
    ]
    sub = {
        "lease_id": lease.lease_id,
        "groups": [{"group_id": group.group_id, "trajectories": trajs}],
    }
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
    from bridge.control.protocol import LeaseRequest, SamplingParams, WorkerProfile
    from bridge.model import tiny_model
    from bridge.tasks import make_task

    with tempfile.TemporaryDirectory() as tmp:
        os.mkdir(os.path.join(tmp, "tok"))
        tiny_model.save_tokenizer(os.path.join(tmp, "tok"))
        leased = args.leased_trajectories > 0
        cfg = ControllerConfig(
            staleness=1, groups_per_step=2, vocab_size=100,
            group_size=args.leased_trajectories if leased else 2,
            sampling=SamplingParams(max_tokens=_LEASED_TOKENS if leased else 4),
            rate_limit_per_s=0.0,  # one client heartbeats every pace_ms
        )  # fmt: skip
        ctl = Controller(
            cfg,
            os.path.join(tmp, "controller.db"),
            make_task("arithmetic"),
            codec=TextCodec(os.path.join(tmp, "tok")),
        )
        server = serve_controller(ctl, tmp, ServerOptions())
        profile = WorkerProfile(
            accelerator="cpu", price_per_hour=1.0, max_concurrent_sequences=1 << 16
        )
        (_, hb_token), (sub_worker, sub_token) = ctl.register(profile), ctl.register(profile)
        posts = 1 + args.submitters * args.rounds  # the unmeasured first one included
        if leased:
            ctl.publish(0, manifest_sha256="0" * 64)
            visible = [i for i in range(cfg.vocab_size) if not ctl.scorer.decoder.hidden(i)]
            visible = [i for i in visible if i not in ctl.scorer.decoder.stops]
            bodies = []
            for _ in range(posts):
                r = ctl.lease(sub_worker, LeaseRequest(worker_version=0, max_groups=1))
                assert r.lease is not None, r.reason
                bodies.append(leased_body(r.lease, visible, _LEASED_TOKENS))
        else:
            bodies = [submission_body(args.body_mib)]
        files = []
        for k, body in enumerate(bodies):
            files.append(os.path.join(tmp, f"body-{k}.json"))
            with open(files[-1], "wb") as f:
                f.write(body)
        files_first, files_rest = os.path.join(tmp, "first.json"), os.path.join(tmp, "rest.json")
        with open(files_first, "w") as f:
            json.dump(files[:1], f)
        with open(files_rest, "w") as f:
            json.dump(files[1:] if leased else files * (posts - 1), f)
        # CPU seconds each Controller.submit call costs the thread it runs on: the
        # GIL-bound work of a submission in the server (the parse is in a parser process).
        submit_cpu: list[float] = []
        submit = ctl.submit

        def timed_submit(worker_id, sub):
            t = time.thread_time()
            try:
                return submit(worker_id, sub)
            finally:
                submit_cpu.append(time.thread_time() - t)

        ctl.submit = timed_submit
        rows = []
        try:
            # One submission first: the parser processes (and with leases the reward pool)
            # start at the first large body.
            subprocess.run(
                _client(_SUBMITTERS, server.url, sub_token, files_first, 1, 1),
                capture_output=True, check=True, timeout=600,
            )  # fmt: skip
            first_submit_cpu = list(submit_cpu)
            submit_cpu.clear()
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
                            _SUBMITTERS, server.url, sub_token, files_rest, args.submitters,
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
    out = {
        "headline": {
            "heartbeat_p99_ms_idle": idle["p99_ms"],
            "heartbeat_p99_ms_submissions": busy["p99_ms"],
            "heartbeat_p99_ratio": round(busy["p99_ms"] / max(idle["p99_ms"], 1e-9), 3),
            "body_bytes": len(bodies[0]),
        },
        "rows": rows,
        "load_average": os.getloadavg(),
    }
    if leased:
        # The whole submit path (held leases, valid bodies): beside the headline, which
        # then describes this run too.
        out["leased_submissions"] = {
            "trajectories": cfg.group_size,
            "tokens_per_trajectory": _LEASED_TOKENS,
            "heartbeat_p50_ms_idle": idle["p50_ms"],
            "heartbeat_p50_ms_submissions": busy["p50_ms"],
            "heartbeat_p99_ms_idle": idle["p99_ms"],
            "heartbeat_p99_ms_submissions": busy["p99_ms"],
            "heartbeat_p99_ratio_leased": out["headline"]["heartbeat_p99_ratio"],
            "submit_cpu_s_median": (
                round(sorted(submit_cpu)[len(submit_cpu) // 2], 3) if submit_cpu else None
            ),
            "submit_cpu_s_each": [round(x, 3) for x in submit_cpu],
            "first_submit_cpu_s": [round(x, 3) for x in first_submit_cpu],
            "accepted": busy.get("submit_status") == [200],
        }
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--body_mib", type=float, default=15.5, help="each submission's size")
    p.add_argument("--submitters", type=int, default=3, help="concurrent submissions")
    p.add_argument("--rounds", type=int, default=4, help="submissions per submitter")
    p.add_argument("--pace_ms", type=float, default=10.0, help="between heartbeats")
    p.add_argument("--idle_heartbeats", type=int, default=300, help="in the idle phase")
    p.add_argument(
        "--leased_trajectories", type=int, default=0,
        help="0: bodies for an unknown lease (refused after the parse); N: valid bodies of N "
        "trajectories of 16,384 tokens, each for a lease the submitter holds (the whole "
        "submit path: checks, scoring, acceptance; --body_mib is then unused)",
    )  # fmt: skip
    args = p.parse_args(argv)
    result = run(args)
    print(f"{'phase':12s} {'n':>5s} {'p50 ms':>8s} {'p99 ms':>8s} {'max ms':>8s}")
    for r in result["rows"]:
        print(
            f"{r['phase']:12s} {r['n']:5d} {r['p50_ms']:8.2f} {r['p99_ms']:8.2f} {r['max_ms']:8.2f}"
        )
    print(f"server CPU per submission {result['rows'][1]['server_cpu_ms_per_submission']} ms")
    print(json.dumps(result["headline"]))
    if "leased_submissions" in result:
        print(
            json.dumps({k: v for k, v in result["leased_submissions"].items() if "each" not in k})
        )
    print(f"load average {result['load_average']}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
