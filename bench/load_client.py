"""Simulated rollout workers for bench/controller_load.py: asyncio + aiohttp in one process.

Each simulated worker does what rollout_gpu/worker.py does, minus the model: register with
the join secret, heartbeat every `heartbeat_interval_s` from its own task, lease, "swap"
when told (it adopts `swap_to` at once), "generate" for `gen_s` (x0.5..1.5, a sleep), and
submit a complete group: the leased prompt token ids echoed exactly, completions of a
tiny model's size (the answer's digits, right about half the time, then EOS, encoded with
the run's tokenizer so the controller's reward decodes real text), log-probs and versions
per token. It obeys `retry_after_s` and 429s (Retry-After), and leaves at the end.

Every request is recorded: endpoint, status, latency (client-side, so queueing in this
process counts too), and every group the controller says it accepted, for the audit.
Runs in its own process (`run_clients`) so the clients and the controller do not share a
GIL; the result goes to a JSON file.
"""

from __future__ import annotations

import asyncio
import collections
import json
import multiprocessing
import os
import random
import re
import resource
import time

_PROBLEM = re.compile(r"(-?\d+)\s*([-+*])\s*(-?\d+)\s*=")


class Recorder:
    def __init__(self):
        self.latency = collections.defaultdict(list)  # endpoint -> [seconds]
        self.status = collections.Counter()  # "endpoint status" -> count
        self.transport_errors = collections.Counter()  # endpoint -> count
        # (group id, lease id, wall time): the time orders one group's acceptances across
        # client processes (a group accepted again after a stale drop is stored under the last)
        self.accepted: list[tuple[int, str, float]] = []
        self.duplicates = 0
        self.leases = 0
        self.reasons = collections.Counter()
        self.registered = 0
        self.t0 = time.monotonic()
        self.submitted: list[tuple[float, int]] = []  # (seconds since start, groups accepted)

    def add(self, endpoint: str, status: int, seconds: float) -> None:
        self.latency[endpoint].append(seconds)
        self.status[f"{endpoint} {status}"] += 1


def completion(codec, prompt: str, max_tokens: int, rng: random.Random) -> list[int]:
    """A tiny model's answer to `a<op>b=`: the result (or one off), then EOS."""
    m = _PROBLEM.search(prompt)
    value = rng.randrange(100)
    if m:
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        value = {"+": a + b, "-": a - b, "*": a * b}[op] + rng.choice((0, 0, 1, -1))
    ids = codec.encode(str(value))[: max_tokens - 1]
    return ids + [codec.eos_id]


def submission(codec, lease: dict, version: int, rng: random.Random) -> dict:
    groups = []
    for g in lease["groups"]:
        max_tokens = g["sampling"]["max_tokens"]
        trajs = []
        for i in range(g["n"]):
            ids = completion(codec, g["prompt"], max_tokens, rng)
            trajs.append(
                {
                    "prompt_id": g["prompt_id"],
                    "sample_index": i,
                    "prompt_token_ids": g["prompt_token_ids"],
                    "completion_token_ids": ids,
                    "logprobs": [-rng.uniform(0.01, 3.0) for _ in ids],
                    "versions": [version] * len(ids),
                    "finish_reason": "stop",
                }
            )
        groups.append({"group_id": g["group_id"], "trajectories": trajs})
    return {"lease_id": lease["lease_id"], "groups": groups}


class Fleet:
    def __init__(self, http, url: str, secret: str, codec, cfg: dict, rec: Recorder):
        self.http, self.url, self.secret, self.codec, self.cfg, self.rec = (
            http,
            url,
            secret,
            codec,
            cfg,
            rec,
        )
        self.deadline = time.monotonic() + cfg["ramp_s"] + cfg["duration_s"]

    async def request(
        self, endpoint: str, body: dict | None, token: str | None = None, retried=None
    ):
        """(status, json): 429s waited out, transport errors retried after a second (and
        noted in `retried`: the controller may have done what the lost reply said)."""
        import aiohttp

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        for _ in range(20):
            t0 = time.perf_counter()
            try:
                async with self.http.post(self.url + endpoint, json=body, headers=headers) as r:
                    data = await r.json(content_type=None)
                    status = r.status
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                self.rec.transport_errors[f"{endpoint} {type(e).__name__}"] += 1
                if retried is not None:
                    retried.append(type(e).__name__)
                await asyncio.sleep(1.0)
                continue
            self.rec.add(endpoint, status, time.perf_counter() - t0)
            if status == 429:
                await asyncio.sleep(float(data.get("retry_after_s", 1.0)))
                continue
            return status, data
        return 0, {}

    async def heartbeats(self, token: str, state: dict, interval_s: float, rng) -> None:
        await asyncio.sleep(rng.uniform(0, interval_s))
        while time.monotonic() < self.deadline:
            status, r = await self.request(
                "/v1/heartbeat", {"worker_version": state["version"]}, token
            )
            if status == 200 and r.get("heartbeat_interval_s"):  # set by the controller
                interval_s = r["heartbeat_interval_s"]
            await asyncio.sleep(interval_s * rng.uniform(0.9, 1.1))

    async def worker(self, index: int) -> None:
        cfg, rec = self.cfg, self.rec
        rng = random.Random(cfg["seed"] * 100003 + index)
        await asyncio.sleep(rng.uniform(0, cfg["ramp_s"]))
        profile = {"accelerator": "sim", "price_per_hour": 1.0, "max_concurrent_sequences": 64}
        status, reg = await self.request(
            "/v1/register", {"join_secret": self.secret, "profile": profile}
        )
        if status != 200:
            return
        rec.registered += 1
        token, state = reg["token"], {"version": reg["announcement"]["version"]}
        hb = asyncio.create_task(self.heartbeats(token, state, reg["heartbeat_interval_s"], rng))
        while time.monotonic() < self.deadline:
            body = {"worker_version": state["version"], "max_groups": cfg["max_groups"]}
            status, r = await self.request("/v1/lease", body, token)
            if status != 200:
                await asyncio.sleep(1.0)
                continue
            generating_at = state["version"]
            if r["swap_to"] is not None:
                state["version"] = r["swap_to"]
            rec.reasons[r["reason"]] += 1
            lease = r["lease"]
            if lease is None:
                if r["reason"] != "behind":
                    await asyncio.sleep(max(r["retry_after_s"], 0.05))
                continue
            rec.leases += 1
            await asyncio.sleep(cfg["gen_s"] * rng.uniform(0.5, 1.5))
            sub = submission(self.codec, lease, generating_at, rng)
            retried: list[str] = []
            status, resp = await self.request("/v1/submit", sub, token, retried)
            if status == 200:
                # After a lost reply (the controller was killed), "duplicate" is the
                # acceptance that reply carried.
                got = resp["accepted"] + (resp["duplicates"] if retried else [])
                rec.accepted += [(gid, lease["lease_id"], time.time()) for gid in got]
                rec.submitted.append((time.monotonic() - rec.t0, len(got)))
                rec.duplicates += len(resp["duplicates"])
                if resp["swap_to"] is not None:
                    state["version"] = max(state["version"], resp["swap_to"])
        hb.cancel()
        await self.request("/v1/leave", None, token)


async def _main(url: str, secret: str, tokenizer_dir: str, cfg: dict) -> Recorder:
    import aiohttp

    from bridge.contracts.prompt import TextCodec

    rec = Recorder()
    # Idle connections close on our side before uvicorn's 5 s keep-alive closes them on
    # its side: otherwise a request sent on a connection the server is closing fails.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=3.0)
    timeout = aiohttp.ClientTimeout(total=cfg["timeout_s"])
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        fleet = Fleet(http, url, secret, TextCodec(tokenizer_dir), cfg, rec)
        await asyncio.gather(*(fleet.worker(i) for i in range(cfg["workers"])))
    return rec


def run_clients(url: str, secret: str, tokenizer_dir: str, cfg: dict, out: str) -> None:
    """Process entry point: run the fleet, write the recorder's contents to `out`."""
    try:
        import uvloop

        uvloop.install()  # the load generator should not be the bottleneck
    except ImportError:
        pass
    t0 = time.monotonic()
    rec = asyncio.run(_main(url, secret, tokenizer_dir, cfg))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with open(out, "w") as f:
        json.dump(
            {
                "wall_s": time.monotonic() - t0,
                "cpu_s": usage.ru_utime + usage.ru_stime,
                "latency": rec.latency,
                "status": rec.status,
                "transport_errors": rec.transport_errors,
                "accepted": rec.accepted,
                "submitted": rec.submitted,
                "duplicates": rec.duplicates,
                "leases": rec.leases,
                "reasons": rec.reasons,
                "registered": rec.registered,
            },
            f,
        )


def merge(parts: list[dict]) -> dict:
    """One result of several client processes (bench.controller_load --client_procs)."""
    out = {"wall_s": max(p["wall_s"] for p in parts), "cpu_s": sum(p["cpu_s"] for p in parts)}
    for key in ("latency", "status", "transport_errors", "reasons"):
        merged = collections.defaultdict(list) if key == "latency" else collections.Counter()
        for p in parts:
            for k, v in p[key].items():
                merged[k] += v
        out[key] = dict(merged)
    for key in ("accepted", "submitted"):
        out[key] = [x for p in parts for x in p[key]]
    for key in ("duplicates", "leases", "registered"):
        out[key] = sum(p[key] for p in parts)
    out["processes"] = len(parts)
    return out


def start_client_procs(url, secret, tok_dir, cfg, n_procs, workdir):
    """Split cfg's fleet over `n_procs` spawned `run_clients` processes (one asyncio process
    saturates near 1000 workers); returns (processes, their JSON output paths)."""
    procs, outs = [], []
    for i in range(n_procs):
        n = cfg["workers"] // n_procs + (i < cfg["workers"] % n_procs)
        outs.append(os.path.join(workdir, f"clients{i}.json"))
        part = {**cfg, "workers": n, "seed": cfg["seed"] * 1000 + i}
        procs.append(
            multiprocessing.get_context("spawn").Process(
                target=run_clients, args=(url, secret, tok_dir, part, outs[i])
            )
        )
        procs[-1].start()
    return procs, outs
