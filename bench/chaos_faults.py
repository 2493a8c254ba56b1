"""Fault injectors and the independent observer of the chaos soak (bench/chaos.py).

- `Observer`: polls `<workdir>/controller.db` read-only (SQLite WAL) a few times a second
  and keeps every group's observed state changes (with the poll time), the controller's
  `next_step`, and each worker's recorded version. The controller deletes
  consumed groups once a checkpoint holds them, so the audit needs these observations, not
  the final database alone. A consumed group stays in the database for at least one learner
  step after it was consumed, so a 0.2 s poll sees every consumption.
- `corrupt_next_version`: waits for a new manifest under `<store>/manifests/` and flips
  bytes in the largest chunk file of that version at once (the manifest is written last, so
  the version is then complete and its chunk digests already recorded), then reads the
  corrupted array back (from a private copy of the version, corrupted the same way: the
  learner may garbage-collect the live one first) through the reader every worker loads
  with (`WeightStore.read`, which verifies each chunk against the manifest) and records
  whether it refused. That probe is
  what makes the fault bite every run: a fast learner may announce the next version before
  any worker tried the corrupted one, so worker refusals are reported but not guaranteed.
- `hostile_client`: joins with the join secret and posts forged submissions (wrong prompt
  ids, out-of-vocab tokens, a claimed reward, unknown lease and group ids); returns what the
  controller answered to each.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import tempfile
import threading
import time
import urllib.error
import urllib.request

from bridge.store.layout import LAYOUT
from bridge.store.weight_store import CorruptVersionError, WeightStore


class Observer(threading.Thread):
    def __init__(self, db_path: str, period_s: float = 0.2):
        super().__init__(daemon=True)
        self.db_path, self.period_s = db_path, period_s
        self.run_index = 0  # which binary run is live (the bench sets it)
        self.stop_event = threading.Event()
        self.lock = threading.Lock()
        self.history: dict[tuple, list[tuple]] = {}  # -> [(t, state, min_version, step, lease)]
        self.epoch = 0
        self.next_step_max = 0
        self.present: set[int] = set()  # group ids in the latest poll
        # (epoch, worker_id) -> {version: when first seen at it}
        self.worker_versions: dict[tuple, dict[int, float]] = {}
        self.lease_worker: dict[str, str] = {}  # lease_id -> worker_id
        self.quarantined: set[tuple] = set()  # (epoch, worker_id)
        self.polls = 0
        self.errors = 0
        # A rerun after kill -9 may move controller.db aside and start a fresh one (group ids
        # start again at 1): groups are keyed (epoch, group_id), epoch = index of the file.
        self.inodes: list[int] = []
        self.epoch_run: dict[int, int] = {}  # epoch -> the run that opened it

    def run(self) -> None:
        while not self.stop_event.wait(self.period_s):
            try:
                self.poll()
            except sqlite3.Error:
                self.errors += 1

    def poll(self) -> None:
        if not os.path.exists(self.db_path):
            return
        ino = os.stat(self.db_path).st_ino
        conn = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=2.0)
        try:
            conn.execute("BEGIN")  # one snapshot for all three reads
            rows = conn.execute(
                "SELECT group_id, state, min_version, consumed_step, lease_id FROM groups"
            ).fetchall()
            kv = conn.execute("SELECT value FROM kv WHERE key='next_step'").fetchall()
            workers = conn.execute("SELECT worker_id, version FROM workers").fetchall()
            leases = conn.execute("SELECT lease_id, worker_id FROM leases").fetchall()
            bad = conn.execute("SELECT worker_id FROM quarantine").fetchall()
            conn.execute("COMMIT")
        finally:
            conn.close()
        now = time.time()
        with self.lock:
            if ino not in self.inodes:
                self.inodes.append(ino)
                self.epoch_run[len(self.inodes) - 1] = self.run_index
            epoch = self.inodes.index(ino)
            self.polls += 1
            if kv:
                self.next_step_max = max(self.next_step_max, int(json.loads(kv[0][0])))
            self.epoch = epoch
            self.present = {(epoch, r[0]) for r in rows}
            for gid, state, mv, step, lease in rows:
                gid = (epoch, gid)
                h = self.history.setdefault(gid, [])
                if not h or h[-1][1:] != (state, mv, step, lease):
                    h.append((now, state, mv, step, lease))
            for wid, v in workers:
                self.worker_versions.setdefault((epoch, wid), {}).setdefault(int(v), now)
            self.lease_worker.update(dict(leases))
            self.quarantined |= {(epoch, w) for (w,) in bad}

    def dump(self, path: str) -> None:
        with self.lock, open(path, "w") as f:
            json.dump(
                {
                    "history": {f"{e}/{g}": h for (e, g), h in self.history.items()},
                    "epoch_run": self.epoch_run,
                    "next_step_max": self.next_step_max,
                    "worker_versions": {
                        f"{e}/{w}": sorted(v) for (e, w), v in self.worker_versions.items()
                    },
                },
                f,
            )

    def stop(self) -> None:
        self.stop_event.set()
        self.join(timeout=5)
        self.poll()


def largest_chunk(version_dir: str) -> str | None:
    best, size = None, -1
    for root, _, files in os.walk(version_dir):
        for name in files:
            path = os.path.join(root, name)
            if name != "zarr.json" and os.path.getsize(path) > size:
                best, size = path, os.path.getsize(path)
    return best


def corrupt_versions(store_dir: str, count: int, timeout_s: float) -> list[dict]:
    """Corrupt the next `count` versions that appear (a fast learner may publish the next
    version before any worker tried the first: then the workers skip it)."""
    return [corrupt_next_version(store_dir, timeout_s) for _ in range(count)]


def corrupt_next_version(store_dir: str, timeout_s: float) -> dict:
    """Flip bytes in a chunk of the next version whose manifest appears; returns a record."""
    mdir = os.path.join(store_dir, LAYOUT.manifests)
    seen = set(os.listdir(mdir)) if os.path.isdir(mdir) else set()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        names = set(os.listdir(mdir)) if os.path.isdir(mdir) else set()
        new = sorted(n for n in names - seen if n.endswith(".json"))
        if new:
            version = int(new[-1].split(".")[0])
            path = largest_chunk(os.path.join(store_dir, "data", f"{version:012d}"))
            if path is None:
                return {"version": version, "outcome": "no chunk file found"}
            chunk = os.path.relpath(path, store_dir)
            # The probe reads a private copy of the version (its manifest and the array),
            # corrupted the same way: the learner may garbage-collect the live version
            # before a probe on a loaded box gets to read it.
            probe_dir = tempfile.mkdtemp(prefix="chaos_probe_")
            array_dir = os.path.join(*chunk.split(os.sep)[:3])
            shutil.copytree(os.path.join(store_dir, array_dir), os.path.join(probe_dir, array_dir))
            os.makedirs(os.path.join(probe_dir, LAYOUT.manifests))
            shutil.copy(os.path.join(mdir, new[-1]), os.path.join(probe_dir, LAYOUT.manifests))
            for target in (path, os.path.join(probe_dir, chunk)):
                _flip_middle(target)
            at = time.time()
            with open(os.path.join(mdir, new[-1]), "rb") as f:
                manifest = f.read()
            probe = probe_read(probe_dir, version, chunk)
            shutil.rmtree(probe_dir, ignore_errors=True)
            return {
                "version": version,
                "chunk": chunk,
                "at": at,
                "manifest": manifest,
                "probe": probe,
            }
        time.sleep(0.005)
    return {"version": None, "outcome": "no new version appeared"}


def corrupt_version(store_dir: str, version: int) -> str:
    """Flip bytes in the largest chunk file of a published `version` in a file store, as
    `corrupt_next_version` does; returns the chunk's path relative to the store."""
    path = largest_chunk(os.path.join(store_dir, "data", f"{version:012d}"))
    if path is None:
        raise FileNotFoundError(f"version {version} has no chunk file in {store_dir}")
    _flip_middle(path)
    return os.path.relpath(path, store_dir)


def _flip_middle(path: str, count: int = 16) -> None:
    with open(path, "r+b") as f:
        data = bytearray(f.read())
        mid = len(data) // 2
        for i in range(mid, min(mid + count, len(data))):
            data[i] ^= 0xFF
        f.seek(0)
        f.write(data)


def probe_read(store_dir: str, version: int, chunk: str) -> dict:
    """Read the array holding `chunk` (data/<version>/<array>/c/...) as a worker would."""
    name = chunk.split(os.sep)[2]
    try:
        WeightStore(store_dir).read_all(version, [name])
    except CorruptVersionError as e:
        return {"refused": True, "array": name, "error": str(e)[:300]}
    except Exception as e:  # noqa: BLE001 - anything but a refusal is a finding
        return {"refused": False, "array": name, "error": f"{type(e).__name__}: {e}"[:300]}
    return {"refused": False, "array": name, "error": None}


def _post(url: str, path: str, body, token: str | None = None, raw: bool = False):
    data = body if raw else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, method="POST")
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, e.read()[:200].decode(errors="replace")


def hostile_client(url: str, secret: str, vocab_size: int) -> dict:
    """Join with the secret, take one real lease, post forged submissions, release it."""
    profile = {"accelerator": "cpu", "price_per_hour": 0.0, "max_concurrent_sequences": 1}
    code, reg = _post(url, "/v1/register", {"join_secret": secret, "profile": profile})
    if code != 200:
        return {"register": code, "worker_id": None, "attempts": []}
    token, worker_id = reg["token"], reg["worker_id"]
    lease = None
    for _ in range(60):  # the controller may be full or say we are behind: keep asking
        version = reg["announcement"]["version"]
        code, r = _post(url, "/v1/lease", {"worker_version": version, "max_groups": 1}, token)
        if code == 200 and r.get("lease"):
            lease = r["lease"]
            break
        if code == 200:
            reg["announcement"] = r["announcement"]
        time.sleep(0.5)

    def traj(group, **over):
        n = 3
        t = {
            "prompt_id": group["prompt_id"],
            "sample_index": 0,
            "prompt_token_ids": group["prompt_token_ids"],
            "completion_token_ids": [1] * n,
            "logprobs": [-0.1] * n,
            "versions": [version] * n,
            "finish_reason": "stop",
        }
        t.update(over)
        return [dict(t, sample_index=i) for i in range(group["n"])]

    attempts = []

    def submit(name, lease_id, groups, raw=None):
        body = raw if raw is not None else {"lease_id": lease_id, "groups": groups}
        code, r = _post(url, "/v1/submit", body, token, raw=isinstance(body, bytes))
        attempts.append({"attempt": name, "status": code, "answer": str(r)[:160]})

    if lease:
        g, lid = lease["groups"][0], lease["lease_id"]
        gid = g["group_id"]
        wrong_prompt = [t + 1 for t in g["prompt_token_ids"]]
        submit(
            "wrong prompt ids",
            lid,
            [{"group_id": gid, "trajectories": traj(g, prompt_token_ids=wrong_prompt)}],
        )
        oov = [vocab_size + 7, 10**6, -3]
        submit(
            "out-of-vocab tokens",
            lid,
            [{"group_id": gid, "trajectories": traj(g, completion_token_ids=oov)}],
        )
        claimed = [dict(t, reward=1.0) for t in traj(g)]
        submit("claimed reward", lid, [{"group_id": gid, "trajectories": claimed}])
        submit("wrong group id", lid, [{"group_id": gid + 10**6, "trajectories": traj(g)}])
        submit("too few samples", lid, [{"group_id": gid, "trajectories": traj(g)[:1]}])
        submit(
            "future version",
            lid,
            [{"group_id": gid, "trajectories": traj(g, versions=[10**6] * 3)}],
        )
        submit(
            "unknown lease", "lease-that-never-was", [{"group_id": gid, "trajectories": traj(g)}]
        )
        submit("malformed json", lid, None, raw=b'{"lease_id": ')
        _post(url, "/v1/release", {"lease_id": lid, "reason": "chaos garbage client"}, token)
    else:
        submit("unknown lease", "lease-that-never-was", [{"group_id": 1, "trajectories": []}])
    _post(url, "/v1/leave", {}, token)
    return {
        "register": 200,
        "worker_id": worker_id,
        "lease_id": lease["lease_id"] if lease else None,
        "attempts": attempts,
    }
