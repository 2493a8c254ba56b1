"""The processes of one chaos-soak run directory (bench/chaos.py): the training binary
(rerun with the same workdir after each kill), the bench's own rollout workers (restarted
when they exit), the event log `<workdir>/chaos_events.jsonl`, and the fault actions.

With a testbed (`bed`, bench/netbed.py: hosts `learner` and `w0`..`w{n-1}`) the binary runs
in the learner's network namespace and each worker in its own, so every controller call and
every relay chunk crosses a kernel-shaped link; the network faults (a worker's link cut
while it is mid-version or holds a lease, the learner's uplink flapping, a worker's uplink
10x slower) act on those links. The weight store stays a local directory, read by path.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from bench import arms, chaos_faults, netbed

ROOT = arms.ROOT
RELAY_PORT = 7070  # a worker's relay in its own namespace: a fixed port the bench can poll


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Soak:
    """One run directory: the binary (rerun as needed), the bench's workers, the events."""

    def __init__(self, config: str, workdir: str, overrides: list[str], n_workers: int,
                 relay: bool = False, bed: netbed.Netbed | None = None):  # fmt: skip
        self.config, self.workdir, self.n, self.relay = config, workdir, n_workers, relay
        self.bed = bed
        self.port = free_port()
        host = bed.ip("learner") if bed else "127.0.0.1"
        # workers call from their own addresses: a testbed is the trusted LAN plain HTTP needs
        lan = [f"controller.host={host}", "controller.allow_plain_http=True"] if bed else []
        self.overrides = [
            "local_workers=0",
            f"controller.port={self.port}",
            *(["bridge.broadcast=chain"] if relay else []),  # peers relay chunks (chaos_peer)
            *lan,
            *overrides,
        ]
        self.url = f"http://{host}:{self.port}"
        self.binary: subprocess.Popen | None = None
        self.runs = 0
        self.run_starts: list[float] = []
        self.workers: list[subprocess.Popen | None] = [None] * n_workers
        self.paused: set[int] = set()  # SIGSTOPped or killed on purpose: not restarted
        self.supervise = True
        self.events: list[dict] = []
        self.t0 = time.time()
        self.lock = threading.Lock()
        self.wlogs = os.path.join(workdir, "chaos_workers")
        os.makedirs(self.wlogs, exist_ok=True)
        self.obs = chaos_faults.Observer(os.path.join(workdir, "controller.db"))

    def event(self, fault: str, target: str, outcome: str, **extra) -> None:
        e = {
            "t": round(time.time() - self.t0, 1),
            "fault": fault,
            "target": target,
            "outcome": outcome,
            **extra,
        }
        with self.lock:
            self.events.append(e)
            with open(os.path.join(self.workdir, "chaos_events.jsonl"), "a") as f:
                f.write(json.dumps(e) + "\n")
        print(f"[{e['t']:>7.1f}s] {fault:<15} {target:<10} {outcome}", flush=True)

    # -- the training binary -------------------------------------------------------------
    def start_binary(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "learner_jax.train",
            f"--config={self.config}",
            f"--workdir={self.workdir}",
            *[f"--config.{kv}" for kv in self.overrides],
        ]
        cmd = self.bed.exec_argv("learner", cmd) if self.bed else cmd
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("XLA_FLAGS", None)
        log = open(os.path.join(self.workdir, f"binary-{self.runs}.log"), "w")  # noqa: SIM115
        self.obs.run_index = self.runs
        self.run_starts.append(time.time())
        self.binary = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.runs += 1

    def rl_rows(self) -> int:
        path = os.path.join(self.workdir, "metrics.jsonl")
        if not os.path.exists(path):
            return 0
        with open(path) as f:
            return len({json.loads(x)["step"] for x in f if '"phase": "rl"' in x})

    def wait_serving(self, timeout_s: float = 600) -> bool:
        """Until the running binary has logged an RL step since it started."""
        start, deadline = self.rl_rows(), time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.binary.poll() is not None:
                return False
            if self.rl_rows() > start:
                return True
            time.sleep(0.5)
        return False

    def resumed_from(self, run: int) -> int | None:
        with open(os.path.join(self.workdir, f"binary-{run}.log"), errors="replace") as f:
            for line in f:
                if "resumed from step" in line:
                    return int(line.split("resumed from step")[1].split()[0])
        return None

    # -- workers -------------------------------------------------------------------------
    def start_worker(self, i: int) -> None:
        env = dict(
            os.environ,
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            TOKENIZERS_PARALLELISM="false",
            HF_HUB_OFFLINE="1",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            OMP_NUM_THREADS="1",
        )
        env.pop("XLA_FLAGS", None)
        cmd = [
            sys.executable,
            "-m",
            "rollout_gpu.worker",
            f"--controller={self.url}",
            f"--token_file={os.path.join(self.workdir, 'join_token')}",
            f"--cache_dir={os.path.join(self.wlogs, f'cache-{i}')}",
            "--max_num_seqs=64",
            "--cpu_kvcache_gib=1",
            f"--seed={1000 + i}",
            "--relay" if self.relay else "--norelay",
            "--max_backoff_s=2",
            "--grace_s=5",
            f"--region=chaos-{i}",
        ]
        if self.bed:
            ip = self.bed.ip(f"w{i}")
            cmd = self.bed.exec_argv(f"w{i}", [*cmd, f"--relay_host={ip}",
                                               f"--relay_port={RELAY_PORT}"])  # fmt: skip
        log = open(os.path.join(self.wlogs, f"worker-{i}.log"), "ab")  # noqa: SIM115
        self.workers[i] = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def supervisor(self) -> None:
        while self.supervise:
            for i, p in enumerate(self.workers):
                if i in self.paused or (p is not None and p.poll() is None):
                    continue
                if not os.path.exists(os.path.join(self.workdir, "join_token")):
                    continue
                if p is not None:
                    self.event("worker_exit", f"worker-{i}", f"exit {p.returncode}; restarted")
                self.start_worker(i)
            time.sleep(1.0)

    def stop_all(self) -> None:
        self.supervise = False
        for p in self.workers:
            if p is not None and p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.terminate()
        for p in self.workers:
            if p is not None:
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()

    def kill_everything(self) -> None:
        """On a failure: nothing the bench started outlives it."""
        self.supervise = False
        if self.binary is not None and self.binary.poll() is None:
            os.killpg(self.binary.pid, signal.SIGKILL)
            self.binary.wait()
        for p in self.workers:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        self.obs.stop_event.set()

    # -- faults --------------------------------------------------------------------------
    def kill_worker(self, rng: random.Random) -> None:
        i = rng.randrange(self.n)
        p = self.workers[i]
        if p is None or p.poll() is not None or i in self.paused:
            self.event("worker_kill", f"worker-{i}", "skipped (not running)")
            return
        self.paused.add(i)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        time.sleep(2.0)
        self.start_worker(i)
        self.paused.discard(i)
        self.event("worker_kill", f"worker-{i}", f"kill -9 pid {p.pid}; restarted")

    def kill_binary(self) -> None:
        pid = self.binary.pid
        os.killpg(pid, signal.SIGKILL)
        self.binary.wait()
        self.obs.poll()  # the dead run's final database, before a rerun may move it aside
        self.start_binary()
        ok = self.wait_serving()
        back = self.resumed_from(self.runs - 1)
        self.event(
            "binary_kill",
            "learner",
            f"kill -9 pid {pid}; rerun resumed from step {back}"
            f"; {'training again' if ok else 'NOT training again'}",
        )

    def restart_binary(self) -> None:
        pid = self.binary.pid
        self.binary.send_signal(signal.SIGINT)
        rc = self.binary.wait(timeout=300)
        self.obs.poll()
        self.start_binary()
        ok = self.wait_serving()
        back = self.resumed_from(self.runs - 1)
        self.event(
            "binary_restart",
            "controller",
            f"SIGINT pid {pid} -> exit {rc}; rerun "
            f"resumed from step {back}; {'training again' if ok else 'NOT training'}",
        )

    def held_lease(self, i: int) -> str | None:
        """An active lease of bench worker `i` in the controller's database, if any."""
        import sqlite3

        db = os.path.join(self.workdir, "controller.db")
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=2.0)
        try:
            rows = conn.execute(
                "SELECT l.lease_id FROM leases l JOIN workers w ON l.worker_id=w.worker_id"
                " WHERE l.state='active' AND w.left_at IS NULL AND w.profile LIKE ?",
                (f'%"region":"chaos-{i}"%',),
            ).fetchall()
        finally:
            conn.close()
        return rows[0][0] if rows else None

    def sigstop(self, rng: random.Random, hold_s: float) -> None:
        """SIGSTOP a worker while it holds a lease, past the lease TTL, then SIGCONT."""
        i = rng.randrange(self.n)
        p = self.workers[i]
        if p is None or p.poll() is not None or i in self.paused:
            self.event("sigstop", f"worker-{i}", "skipped (not running)")
            return
        self.paused.add(i)
        lease, deadline = None, time.monotonic() + 60
        while lease is None and time.monotonic() < deadline:
            if self.held_lease(i):
                os.kill(p.pid, signal.SIGSTOP)
                lease = self.held_lease(i)  # still held once stopped (not submitted meanwhile)
                if lease is None:
                    os.kill(p.pid, signal.SIGCONT)
            time.sleep(0.02)
        if lease is None:  # never caught holding one: stop it anyway
            os.kill(p.pid, signal.SIGSTOP)
        self.event(
            "sigstop", f"worker-{i}", f"SIGSTOP pid {p.pid} for {hold_s:.0f}s, lease {lease}"
        )
        time.sleep(hold_s)
        os.kill(p.pid, signal.SIGCONT)
        self.paused.discard(i)
        time.sleep(10)
        with open(os.path.join(self.wlogs, f"worker-{i}.log"), errors="replace") as f:
            refused = [x for x in f if lease and f"lease {lease}" in x and "refused" in x]
        self.event(
            "sigcont",
            f"worker-{i}",
            f"SIGCONT; {'alive' if p.poll() is None else 'exited'}"
            + (
                f"; its late submission: {refused[-1].split('] ', 1)[-1].strip()[:160]}"
                if refused
                else ""
            ),
        )

    def corrupt(self, count: int) -> list[dict]:
        recs = chaos_faults.corrupt_versions(os.path.join(self.workdir, "weights"), count, 120)
        for rec in recs:
            rec["epoch"] = self.obs.epoch  # the controller database it was announced from
        for rec in recs:
            self.event(
                "corrupt_chunk",
                f"v{rec.get('version')}",
                (
                    f"flipped 16 bytes in {rec['chunk']}; probe read "
                    + ("refused" if rec["probe"]["refused"] else "ACCEPTED")
                )
                if rec.get("chunk")
                else rec["outcome"],
            )
        return recs

    def garbage(self, vocab_size: int) -> dict:
        with open(os.path.join(self.workdir, "join_token")) as f:
            secret = f.read().strip()
        r = chaos_faults.hostile_client(self.url, secret, vocab_size)
        codes = ", ".join(f"{a['attempt']}:{a['status']}" for a in r["attempts"])
        self.event(
            "garbage_client", r.get("worker_id") or "?", codes or f"register {r['register']}"
        )
        return r

    # -- network faults (a testbed only) -------------------------------------------------
    def mid_version(self, i: int) -> bool:
        """Worker `i`'s relay holds part of a version (it is fetching, and serving what it
        holds to its children): a cut now is a cut mid-chunk for someone."""
        url = f"http://{self.bed.ip(f'w{i}')}:{RELAY_PORT}/status"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                versions = json.loads(r.read())["versions"].values()
        except (OSError, ValueError):
            return False
        return any(0 < v["have"] < v["total"] and not v["complete"] for v in versions)

    def net_partition(self, rng: random.Random, seconds: float) -> None:
        """Cut a worker's link for `seconds`: mid-version when its relay is fetching one
        (a relay chain), else while it holds a lease; within 60 s, or then anyway."""
        i = rng.randrange(self.n)
        caught = "anyway (never caught mid-version or holding a lease)"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.relay and self.mid_version(i):
                caught = "mid-version"
                break
            if not self.relay and self.held_lease(i):
                caught = "holding a lease"
                break
            time.sleep(0.02)
        r = netbed.partition_for(self.bed, f"w{i}", seconds)
        self.event("net_partition", f"worker-{i}", f"link down {r['seconds']:.1f}s {caught}; up")

    def net_flap(self, times: int, down_s: float, up_s: float) -> None:
        netbed.flap(self.bed, "learner", times, down_s, up_s)
        self.event("net_flap", "learner", f"uplink down {times}x {down_s:.0f}s, up {up_s:.0f}s")

    def net_slow(self, rng: random.Random, factor: float) -> None:
        """One worker's uplink `factor` times slower, for the rest of the soak."""
        i = rng.randrange(self.n)
        r = netbed.slow(self.bed, f"w{i}", factor)
        self.event("net_slow", f"worker-{i}", f"uplink {r['from_mbps']:g} -> {r['to_mbps']:g} MB/s")
