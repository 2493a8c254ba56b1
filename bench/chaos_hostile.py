"""Hostile workers for the chaos soak (issue 23, classes 5, 6, 7 and 9), each a thread that
joins with the run's join secret and speaks the worker protocol over HTTP like a real
worker, for the whole soak or until the controller revokes its token:

  mixed_tags     (5) tags the second half of each completion with a version older than
                 its lease (refused: 422);
  picker         (6) submits the greedy answer of the CURRENT policy (transformers on the
                 version read back from the store) with its true log-probs: the log-prob
                 audit passes it, the sampling check must not;
  hidden_tokens  (7) hides a special token inside each answer ("4<pad>2"), scored 0 and
                 counted against it; its made-up log-probs get it audited out too;
  junk           (9) a $0 worker that asks for many groups and returns random tokens fast
                 with made-up log-probs.

`result` per worker: its class, worker id, submit statuses, groups accepted, whether it
was quarantined (a 401 on its token) and `caught_after_s`, the seconds from its first
registration to the first 401 (None if never). A hostile worker is neutralised when it was
quarantined or none of its groups were accepted. From loopback the bench's registrations
are the operator's own ("local" identity, never barred: identity.py), so a quarantined
hostile thread stops rather than registering again.
"""

from __future__ import annotations

import os
import random
import threading
import time

from bench.chaos_faults import _post
from bridge.model import tiny_model

CLASSES = ("mixed_tags", "picker", "hidden_tokens", "junk")


class HostileWorker(threading.Thread):
    def __init__(self, kind: str, url: str, secret: str, workdir: str, seed: int = 0):
        super().__init__(daemon=True, name=f"hostile-{kind}")
        if kind not in CLASSES:
            raise ValueError(f"hostile class must be one of {CLASSES}, got {kind!r}")
        self.kind, self.url, self.secret, self.workdir = kind, url, secret, workdir
        self.rng, self.stop_event = random.Random(seed), threading.Event()
        self.token, self.version, self.store = None, 0, None
        self.result = {"class": kind, "worker_id": None, "statuses": {}, "accepted_groups": 0,
                       "quarantined": False, "errors": 0, "last_error": "",
                       "caught_after_s": None}  # fmt: skip
        self._registered_at: float | None = None
        self._hf, self._hf_version = None, None

    def stop(self) -> dict:
        self.stop_event.set()
        self.join(timeout=60)
        return self.result

    def run(self) -> None:
        while not self.stop_event.is_set() and not self.result["quarantined"]:
            try:
                if self.token is None:
                    self._register()
                    continue
                self._one_lease()
            except Exception as e:  # noqa: BLE001 - the binary may be down (killed): retry
                self.result["errors"] += 1
                self.result["last_error"] = f"{type(e).__name__}: {e}"[:200]
                self.stop_event.wait(1.0)

    def _register(self) -> None:
        profile = {"accelerator": "cpu", "price_per_hour": 0.0,
                   "max_concurrent_sequences": 64 if self.kind == "junk" else 4}  # fmt: skip
        code, r = _post(self.url, "/v1/register", {"join_secret": self.secret, "profile": profile})
        if code != 200:
            raise RuntimeError(f"register: {code}")
        self.token, self.result["worker_id"] = r["token"], r["worker_id"]
        if self._registered_at is None:
            self._registered_at = time.time()
        self._announce(r["announcement"])

    def _announce(self, ann: dict) -> None:
        self.version, self.store = max(0, ann["version"]), ann.get("store") or self.store

    def _one_lease(self) -> None:
        body = {"worker_version": self.version, "max_groups": 8 if self.kind == "junk" else 1}
        code, r = _post(self.url, "/v1/lease", body, self.token)
        if code == 401:
            self._caught()
            return
        if code != 200:
            raise RuntimeError(f"lease: {code}")
        self._announce(r["announcement"])
        lease = r.get("lease")
        if not lease:
            self.stop_event.wait(0.5)
            return
        groups = [self._group(g) for g in lease["groups"]]
        if any(g is None for g in groups):  # nothing to forge yet (version 0 for mixed_tags)
            _post(self.url, "/v1/release", {"lease_id": lease["lease_id"]}, self.token)
            self.stop_event.wait(1.0)
            return
        code, r = _post(self.url, "/v1/submit", {"lease_id": lease["lease_id"], "groups": groups},
                        self.token)  # fmt: skip
        st = self.result["statuses"]
        st[str(code)] = st.get(str(code), 0) + 1
        if code == 200:
            self.result["accepted_groups"] += len(r["accepted"])
        elif code == 401:
            self._caught()
        else:
            _post(self.url, "/v1/release", {"lease_id": lease["lease_id"]}, self.token)
        if self.kind != "junk":
            self.stop_event.wait(0.5)  # about an honest worker's pace; junk goes flat out

    def _caught(self) -> None:
        self.result["quarantined"] = True
        self.result["caught_after_s"] = round(time.time() - self._registered_at, 1)

    def _group(self, g: dict) -> dict | None:
        n, max_tokens, v = g["n"], g["sampling"]["max_tokens"], self.version
        out = []
        for i in range(n):
            if self.kind == "mixed_tags":
                if v < 1:
                    return None
                ids = [self.rng.randrange(3, 13) for _ in range(4)] + [tiny_model.EOS_ID]
                lps, tags = [-1.0] * len(ids), [v, v, v - 1, v - 1, v - 1]
            elif self.kind == "picker":
                ids, lps = self._greedy(g["prompt_token_ids"], max_tokens)
                tags = [v] * len(ids)
            elif self.kind == "hidden_tokens":
                ids = [self.rng.randrange(3, 13), tiny_model.PAD_ID, self.rng.randrange(3, 13)]
                ids.append(tiny_model.EOS_ID)
                lps, tags = [-0.5] * len(ids), [v] * len(ids)
            else:  # junk
                ids = [self.rng.randrange(3, 100) for _ in range(max_tokens)]
                lps, tags = [-0.01] * len(ids), [v] * len(ids)
            stop = ids[-1] == tiny_model.EOS_ID
            out.append(dict(prompt_id=g["prompt_id"], sample_index=i,
                            prompt_token_ids=g["prompt_token_ids"], completion_token_ids=ids,
                            logprobs=lps, versions=tags,
                            finish_reason="stop" if stop else "length"))  # fmt: skip
        return {"group_id": g["group_id"], "trajectories": out}

    def _greedy(self, prompt: list[int], max_tokens: int):
        """The current policy's greedy answer and its true log-probs (temperature 1)."""
        import torch

        model = self._model()
        ids, lps = list(prompt), []
        with torch.no_grad():
            for _ in range(max_tokens):
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
                row = torch.log_softmax(logits, -1)
                ids.append(int(row.argmax()))
                lps.append(float(row.max()))
                if ids[-1] == tiny_model.EOS_ID:
                    break
        return ids[len(prompt) :], lps

    def _model(self):
        import torch
        from transformers import AutoModelForCausalLM

        from bridge.store.weight_store import WeightStore

        if self._hf is None:
            torch.set_num_threads(1)
            path = os.path.join(self.workdir, "model")
            self._hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        if self._hf_version != self.version and self.store is not None:
            tensors = WeightStore(self.store).read_all(self.version)
            sd = {k: torch.from_numpy(a.astype("float32")) for k, a in tensors.items()}
            self._hf.load_state_dict(sd, strict=False)
            self._hf.tie_weights()
            self._hf_version = self.version
        return self._hf


def start(url: str, secret: str, workdir: str, classes=CLASSES, seed: int = 0):
    workers = [HostileWorker(k, url, secret, workdir, seed + i) for i, k in enumerate(classes)]
    for w in workers:
        w.start()
    return workers


def verdict(results: list[dict], quarantined: set[str]) -> dict:
    """The soak's check: no honest worker quarantined, every hostile one neutralised."""
    hostile = {r["worker_id"] for r in results if r["worker_id"]}
    per = {}
    for r in results:
        q = r["worker_id"] in quarantined
        per[r["class"]] = dict(r, quarantined=q, neutralised=q or r["accepted_groups"] == 0)
    honest_quarantined = sorted(quarantined - hostile)
    return {
        "ok": not honest_quarantined
        and all(p["neutralised"] for p in per.values())
        and all(r["worker_id"] for r in results),
        "honest_quarantined": honest_quarantined,
        "hostile": per,
    }
