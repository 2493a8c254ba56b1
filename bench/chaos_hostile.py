"""Hostile workers for the chaos soak (issue 23, classes 5, 6, 7 and 9), each a thread that
joins with the run's join secret and speaks the worker protocol over HTTP like a real
worker, for the whole soak or until the controller revokes its token:

  mixed_tags     (5) tags the second half of each completion with a version older than
                 its lease (refused: 422);
  picker         (6) submits the greedy answer of the CURRENT policy (transformers on the
                 version read back from the store) with its true log-probs: the log-prob
                 audit passes it, the exact check must refuse every group where the greedy
                 answer is not the seeded sampler's draw. It declares an fp32 engine (no
                 margin: a bf16 declaration's near-tie slack is the flip rule's to bound,
                 docs/design/exact-verification.md) and records, per group, how many of
                 its tokens are not the seeded draw: on a policy that has learnt the task
                 most greedy answers ARE the draw, and such a group carries no token it
                 chose;
  hidden_tokens  (7) hides a special token inside each answer ("4<pad>2"), scored 0 and
                 counted against it; its made-up log-probs get it audited out too;
  junk           (9) a $0 worker that asks for many groups and returns random tokens fast
                 with made-up log-probs.

Against the exact check (docs/design/exact-verification.md), classes that sample HONESTLY
with each lease's seed (transformers in float32 on the version read back from the store,
the noise of bridge/contracts/gumbel.py, profile `engine_dtype` float32 so the check gives
them no slack) and report the policy's true log-probs, except for one cheat:

  writer         replaces one sample per group with its own text (the right answer of an
                 arithmetic prompt followed by an advertisement, up to max_tokens);
  cool           samples every token at temperature 0.9 while the lease says the run's;
  reregister     writes the right answer alone into one sample per group (a few tokens)
                 and registers again after every lease, presenting a per-worker credential
                 (identity.py `mint_credential`) as its join secret, so its mismatches add
                 up across its ids and the credential is barred (403) once one of them is
                 quarantined. It stops when barred;
  bestof         a best-of-n picker: one sample per group is the most likely of four draws
                 (the seeded one and three with keys of its own), by the policy's own
                 log-probability, each token drawn honestly at the lease's T;
  evalfab        takes evaluation work only (it gives rollout leases back and asks again
                 every 0.1 s, so it is the idle worker eval leases go to) and answers the
                 greedy (T = 0) evaluation groups with the right answer of the arithmetic
                 prompt: a fabricated evaluation, which must never count
                 (eval_samples.jsonl) however right it is.

Each of these (and the picker) records per accepted group (`result["groups"]`: group id,
worker id, `mismatches`, `tokens`) how many of its tokens are not the seeded sampler's
choice: what the learner's check must find. A group with 0 (the cheat happened to pick the
seeded tokens) carries no token the worker chose. Every class also lists each group it
submitted (`result["submitted"]`, with `mismatches` where it knows them), accepted or not:
a submission the controller took whose answer was lost on the way back still counts.

`result` per worker: its class, worker id, submit statuses, groups accepted, whether it
was quarantined (a 401 on its token) and `caught_after_s`, the seconds from its first
registration to the first 401 (None if never). `verdict` judges each class by what
trained (module function's docstring). From loopback the bench's registrations
with the shared secret are the operator's own ("local" identity, never barred:
identity.py), so a quarantined hostile thread stops rather than registering again. In a
testbed (bench/netbed.py) the bench calls from the root namespace's one address, where the
shared secret is the identity `host:<ip>` and one quarantine bans the address: there each
hostile worker presents a credential of its own (`credentials`, identity `cred:<name>`, as
remote workers should), so catching one does not keep the others from attacking.
"""

from __future__ import annotations

import os
import random
import re
import threading
import time

import numpy as np

from bench.chaos_faults import _post
from bridge.contracts import gumbel
from bridge.control.trust.identity import mint_credential
from bridge.model import tiny_model

CLASSES = ("mixed_tags", "picker", "hidden_tokens", "junk")  # the chaos soak's
# honest seeded samplers but for one cheat
SEEDED = ("writer", "cool", "reregister", "bestof", "evalfab")
BEST_OF = 4
COOL_T = 0.9
AD = " buy now"  # what the writer appends to the right answer
_IMPORT_LOCK = threading.Lock()
BY_RECORD = "the learner's exact-check record"
# What `verdict` adds to a class's result (`recheck` takes them off again)
JUDGED = ("quarantined", "consumed", "differing_submitted", "refused", "trained",
          "trained_differing", "neutralised")  # fmt: skip


class HostileWorker(threading.Thread):
    def __init__(
        self, kind: str, url: str, secret: str, workdir: str, seed: int = 0, credential=False
    ):
        super().__init__(daemon=True, name=f"hostile-{kind}")
        if kind not in CLASSES + SEEDED:
            raise ValueError(f"hostile class must be one of {CLASSES + SEEDED}, got {kind!r}")
        self.kind, self.url, self.secret, self.workdir = kind, url, secret, workdir
        self.rng, self.stop_event = random.Random(seed), threading.Event()
        self.token, self.version, self.store = None, 0, None
        self.result = {"class": kind, "worker_id": None, "statuses": {}, "accepted_groups": 0,
                       "quarantined": False, "errors": 0, "last_error": "",
                       "caught_after_s": None, "worker_ids": [], "groups": [],
                       "barred": False, "eval_groups": 0, "submitted": []}  # fmt: skip
        self._registered_at: float | None = None
        self._hf, self._hf_version, self._tok = None, None, None
        self._record: dict[int, dict] = {}  # group id -> its mismatches and tokens (seeded)
        # reregister presents its own credential (identity cred:<name>), not the shared secret
        own = credential or kind == "reregister"
        self.join_secret = mint_credential(secret, f"hostile-{seed}") if own else secret

    def _done(self) -> bool:
        """Quarantined (token revoked), or for reregister: its credential barred."""
        return self.result["barred" if self.kind == "reregister" else "quarantined"]

    def stop(self) -> dict:
        self.stop_event.set()
        self.join(timeout=60)
        return self.result

    def run(self) -> None:
        while not self.stop_event.is_set() and not self._done():
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
        if self.kind in SEEDED or self.kind == "picker":
            profile["engine_dtype"] = "float32"  # the check's margin is then 1e-3: no slack
        code, r = _post(
            self.url, "/v1/register", {"join_secret": self.join_secret, "profile": profile}
        )
        if code == 403 and self.result["worker_ids"]:
            self.result["barred"] = True  # a worker of this identity was quarantined
            return
        if code != 200:
            raise RuntimeError(f"register: {code}")
        self.token, self.result["worker_id"] = r["token"], r["worker_id"]
        self.result["worker_ids"].append(r["worker_id"])
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
            self.stop_event.wait(0.1 if self.kind == "evalfab" else 0.5)
            return
        evaluation = lease["groups"][0]["sampling"]["temperature"] == 0
        if self.kind in SEEDED and evaluation != (self.kind == "evalfab"):
            # Each seeded class takes only the work it cheats on: evalfab evaluation work
            # (it goes to an idle worker that asks while rollout admission is full: it asks
            # often), the others rollouts (eval leases would take their time).
            _post(self.url, "/v1/release", {"lease_id": lease["lease_id"]}, self.token)
            self.stop_event.wait(0.1 if self.kind == "evalfab" else 0.5)
            return
        try:
            groups = [self._group(g) for g in lease["groups"]]
        except Exception:
            # A lease held past its failure fills the worker's capacity until it expires.
            _post(self.url, "/v1/release", {"lease_id": lease["lease_id"]}, self.token)
            raise
        if any(g is None for g in groups):  # nothing to forge yet (version 0 for mixed_tags)
            _post(self.url, "/v1/release", {"lease_id": lease["lease_id"]}, self.token)
            self.stop_event.wait(1.0)
            return
        self.result["submitted"] += [
            {"group_id": g["group_id"], "worker_id": self.result["worker_id"],
             **{k: v for k, v in self._record.get(g["group_id"], {}).items()
                if k in ("mismatches", "eval")}}
            for g in groups
        ]  # fmt: skip
        code, r = _post(self.url, "/v1/submit", {"lease_id": lease["lease_id"], "groups": groups},
                        self.token)  # fmt: skip
        st = self.result["statuses"]
        st[str(code)] = st.get(str(code), 0) + 1
        if code == 200:
            self.result["accepted_groups"] += len(r["accepted"])
            self.result["groups"] += [
                {"group_id": gid, "worker_id": self.result["worker_id"],
                 **self._record.pop(gid, {})}
                for gid in r["accepted"]
            ]  # fmt: skip
        elif code == 401:
            self._caught()
        else:
            _post(self.url, "/v1/release", {"lease_id": lease["lease_id"]}, self.token)
        if self.kind == "reregister" and code != 401:
            self.token = None  # a new worker id for the next lease, same credential
        if self.kind != "junk":
            self.stop_event.wait(0.5)  # about an honest worker's pace; junk goes flat out

    def _caught(self) -> None:
        if not self.result["quarantined"]:
            self.result["caught_after_s"] = round(time.time() - self._registered_at, 1)
        self.result["quarantined"] = True
        self.token = None  # reregister tries its credential again: 403 once barred

    def _group(self, g: dict) -> dict | None:
        if self.kind in SEEDED:
            return self._seeded_group(g)
        n, max_tokens, v = g["n"], g["sampling"]["max_tokens"], self.version
        out, picked = [], []
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
            picked.append(ids)
            out.append(dict(prompt_id=g["prompt_id"], sample_index=i,
                            prompt_token_ids=g["prompt_token_ids"], completion_token_ids=ids,
                            logprobs=lps, versions=tags,
                            finish_reason="stop" if stop else "length"))  # fmt: skip
        if self.kind == "picker":
            self._record_picked(g, picked)
        return {"group_id": g["group_id"], "trajectories": out}

    def _record_picked(self, g: dict, picked: list[list[int]]) -> None:
        """How many of the picker's tokens are not the seeded sampler's choice (what the
        learner's exact check finds, fp32 both sides). Only for untruncated leases: the
        learner truncates before it adds the noise, and this count does not."""
        s = g["sampling"]
        record = {"tokens": sum(map(len, picked)), "prompt_id": g["prompt_id"]}
        if s["temperature"] == 0:  # an evaluation group: the greedy answer is the honest one
            record["eval"] = True
        untruncated = s["top_k"] <= 0 and s["top_p"] >= 1.0 and s["min_p"] <= 0.0
        if untruncated and (s["temperature"] == 0 or s["seed"] >= 0):  # -1: refused unseen
            temperature = s["temperature"] or 1.0
            seed = s["seed"] if s["temperature"] > 0 else None
            record["mismatches"] = sum(
                self._score(g["prompt_token_ids"], ids, temperature, seed, i)[1]
                for i, ids in enumerate(picked)
            )
        self._record[g["group_id"]] = record

    def _seeded_group(self, g: dict) -> dict:
        """n samples drawn with the lease's seed, but for this class's cheat."""
        s, v, prompt = g["sampling"], self.version, g["prompt_token_ids"]
        if s["top_k"] > 0 or s["top_p"] < 1.0 or s["min_p"] > 0.0:
            raise ValueError("the seeded hostile classes sample untruncated leases only")
        stops = set(s["stop_token_ids"]) | {tiny_model.EOS_ID}
        if s["temperature"] == 0:  # a greedy evaluation group: argmax, no key
            self.result["eval_groups"] += 1
            return self._greedy_group(g, stops)
        args = (prompt, s["seed"], s["max_tokens"], s["temperature"], stops)
        samples = [self._seeded(*args, index=i) for i in range(g["n"])]
        honest = [ids for ids, _ in samples]
        if self.kind == "cool":
            samples = [self._seeded(*args, index=i, use_t=COOL_T) for i in range(g["n"])]
        elif self.kind == "bestof":
            i = self.rng.randrange(g["n"])
            keys = [self.rng.randrange(gumbel.SEED_LIMIT) for _ in range(BEST_OF - 1)]
            draws = [samples[i]] + [self._seeded(prompt, k, *args[2:], index=0) for k in keys]
            samples[i] = max(draws, key=lambda d: sum(d[1]))
        elif self.kind in ("writer", "reregister"):  # one sample is the worker's own text
            i = self.rng.randrange(g["n"])
            ids = self._written(g["prompt"], s["max_tokens"])
            samples[i] = (ids, self._score(prompt, ids, s["temperature"], s["seed"], i)[0])
        # What the learner will find (fp32 both sides: exactly): each submitted token that
        # is not the seeded argmax of the lease's T given its own prefix is a mismatch.
        bad = 0
        if [ids for ids, _ in samples] != honest:
            for i, (ids, _) in enumerate(samples):
                if ids != honest[i]:
                    bad += self._score(prompt, ids, s["temperature"], s["seed"], i)[1]
        self._record[g["group_id"]] = {"mismatches": bad,
                                       "tokens": sum(len(ids) for ids, _ in samples)}  # fmt: skip
        return _submitted(g, samples, v, stops)

    def _greedy_group(self, g: dict, stops: set) -> dict:
        """An evaluation group: the greedy answer (honest), or evalfab's right answer."""
        prompt, v, s = g["prompt_token_ids"], self.version, g["sampling"]
        samples = [self._greedy(prompt, s["max_tokens"]) for _ in range(g["n"])]
        bad = 0
        if self.kind == "evalfab":
            ids = self._written(g["prompt"], s["max_tokens"])
            lps, bad = self._score(prompt, ids, 1.0, None, 0)
            samples = [(ids, lps)] * g["n"]
            bad *= g["n"]
        self._record[g["group_id"]] = {"mismatches": bad, "prompt_id": g["prompt_id"],
                                       "eval": True,
                                       "tokens": sum(len(ids) for ids, _ in samples)}  # fmt: skip
        return _submitted(g, samples, v, stops)

    def _seeded(self, prompt, seed, max_tokens, temperature, stops, index, use_t=None):
        """Sample `index` of a group as the verifiable sampler draws it: token =
        argmax(logits / T + gumbel(seed + index, position, v)), at `use_t` (default the
        lease's T), with the policy's log-probs at the lease's T (what an honest worker
        reports). Incremental decoding (transformers' KV cache)."""
        import torch

        model = self._model()
        lo, hi = gumbel.key_words(seed, index)
        ids, lps, past, fed = list(prompt), [], None, 0
        with torch.no_grad():
            for _ in range(max_tokens):
                out = model(torch.tensor([ids[fed:]]), past_key_values=past, use_cache=True)
                past, fed = out.past_key_values, len(ids)
                logits = out.logits[0, -1].double().numpy()
                z = logits / (use_t or temperature)
                tok = int(np.argmax(z + gumbel.gumbel(lo, hi, len(ids), len(z))))
                ids.append(tok)
                lps.append(float(_log_softmax(logits / temperature)[tok]))
                if tok in stops:
                    break
        return ids[len(prompt) :], lps

    def _score(self, prompt, ids, temperature, seed, index) -> tuple[list[float], int]:
        """The policy's true log-probs of completion `ids` of sample `index` (one forward),
        and how many of its tokens are not the seeded sampler's choice given their prefix
        (seed None: not the argmax, as a greedy evaluation is checked)."""
        import torch

        with torch.no_grad():
            logits = self._model()(torch.tensor([list(prompt) + list(ids)])).logits[0]
        rows = logits.double().numpy()[len(prompt) - 1 : -1] / temperature
        lps, bad = [], 0
        for j, (z, t) in enumerate(zip(rows, ids, strict=True)):
            lps.append(float(_log_softmax(z)[t]))
            if seed is not None:
                z = z + gumbel.gumbel(*gumbel.key_words(seed, index), len(prompt) + j, len(z))
            bad += int(np.argmax(z) != t)
        return lps, bad

    def _written(self, prompt_text: str, max_tokens: int) -> list[int]:
        """The right answer of an arithmetic prompt (else "42"): followed by an advertisement
        (writer), or by the end of sequence (reregister: a few tokens per group, so only
        counting across its worker ids reaches the quarantine rule)."""
        with _IMPORT_LOCK:
            from transformers import AutoTokenizer

        if self._tok is None:
            self._tok = AutoTokenizer.from_pretrained(os.path.join(self.workdir, "model"))
        m = re.search(r"(-?\d+)\s*([-+*])\s*(-?\d+)", prompt_text)
        answer = "42"
        if m:
            a, op, b = int(m[1]), m[2], int(m[3])
            answer = str({"+": a + b, "-": a - b, "*": a * b}[op])
        if self.kind == "writer":
            return self._tok.encode(answer + AD, add_special_tokens=False)[:max_tokens]
        return self._tok.encode(answer, add_special_tokens=False)[: max_tokens - 1] + [
            tiny_model.EOS_ID
        ]

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
        with _IMPORT_LOCK:  # transformers' lazy imports race when threads import at once
            import torch
            from transformers import AutoModelForCausalLM

            from bridge.store.weight_store import WeightStore

        if self._hf is None:
            # No torch.set_num_threads here: it is process-wide, and a vLLM engine in the
            # same process (the test session's) then fails its CPU attention kernel
            # ("thread_num 2 vs. 1"): every later swap's canary raised.
            path = os.path.join(self.workdir, "model")
            # One load at a time: transformers' loading patches torch process-wide (empty
            # init), and two threads loading at once left a model with other weights than
            # the file's (every token of a thread's honest samples then mismatched).
            with _IMPORT_LOCK:
                self._hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
            self._hf.eval()
        if self._hf_version != self.version and self.store is not None:
            tensors = WeightStore(self.store).read_all(self.version)
            sd = {k: torch.from_numpy(a.astype("float32")) for k, a in tensors.items()}
            self._hf.load_state_dict(sd, strict=False)
            self._hf.tie_weights()
            self._hf_version = self.version
        return self._hf


def _submitted(g: dict, samples, version: int, stops: set) -> dict:
    """The submission of group `g`: its (token ids, log-probs) samples, all at `version`."""
    out = [
        dict(prompt_id=g["prompt_id"], sample_index=i, prompt_token_ids=g["prompt_token_ids"],
             completion_token_ids=ids, logprobs=lps, versions=[version] * len(ids),
             finish_reason="stop" if ids[-1] in stops else "length")
        for i, (ids, lps) in enumerate(samples)
    ]  # fmt: skip
    return {"group_id": g["group_id"], "trajectories": out}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def start(url: str, secret: str, workdir: str, classes=CLASSES, seed: int = 0, credentials=False):
    """`credentials`: each worker registers with a credential of its own (module docstring)."""
    workers = [
        HostileWorker(k, url, secret, workdir, seed + i, credential=credentials)
        for i, k in enumerate(classes)
    ]
    for w in workers:
        w.start()
    return workers


def verdict(results: list[dict], quarantined: set[str], checked=None, by_record=None) -> dict:
    """The soak's check: no honest worker quarantined, and no hostile class had a group
    train that carries a token it chose.

    `checked`: the learner's record of every group it checked ((step, group id, worker id,
    refused), bench/exact_log.py `every_check`). A consumption of a hostile worker's group
    that was not refused trained; it may only be a group the class itself recorded as the
    seeded sampler's draw token for token (`mismatches` 0 in `submitted`: the picker's
    greedy answer where the policy's draw is greedy too). Any other trained group fails
    the class: one that differs, or one whose class cannot tell (random or forged
    tokens), whether or not the class was quarantined afterwards. So a class passes either
    way the exact check promises: quarantined, or every group of it that differs from the
    seeded draw refused (a cheat at under exact_quarantine_fraction of its tokens is below
    the quarantine rule, docs/design/trust.md). Evaluation groups train nothing (their
    check is eval_leases_test's).

    Without a record (`checked` None or empty: the exact check is off, or the log is gone)
    it falls back to the record the bench has: a class is neutralised when quarantined or
    none of its groups were accepted. `by_record` (default: whether `checked` holds any
    line) names the way, for `recheck`, which has only the hostile classes' lines."""
    by_record = bool(checked) if by_record is None else by_record
    ids_of = {r["class"]: set(r.get("worker_ids") or []) | ({r["worker_id"]} - {None})
              for r in results}  # fmt: skip
    hostile = set().union(*ids_of.values()) if ids_of else set()
    per = {}
    for r in results:
        ids = ids_of[r["class"]]
        q = bool(ids & quarantined)
        known: dict[tuple[int, str], int | None] = {}
        for g in r.get("submitted", []):  # a group submitted twice: its worst copy counts
            key, m = (g["group_id"], g["worker_id"]), g.get("mismatches")
            old = known.get(key, 0)
            known[key] = None if m is None or old is None else max(m, old)
        mine = [c for c in checked or [] if c[2] in ids]
        trained = [c for c in mine if not c[3]]
        chosen = [list(c) for c in trained if known.get((c[1], c[2])) != 0]
        row = dict(r, quarantined=q, consumed=[list(c) for c in mine],
                   differing_submitted=sum(m != 0 for m in known.values()),
                   refused=sum(c[3] for c in mine), trained=len(trained),
                   trained_differing=chosen)  # fmt: skip
        row["neutralised"] = not chosen if by_record else q or r["accepted_groups"] == 0
        per[r["class"]] = row
    honest_quarantined = sorted(quarantined - hostile)
    return {
        "ok": not honest_quarantined
        and all(p["neutralised"] for p in per.values())
        and all(r["worker_id"] for r in results),
        "judged_by": BY_RECORD if by_record else "accepted groups",
        "quarantined": sorted(quarantined),
        "honest_quarantined": honest_quarantined,
        "hostile": per,
    }


def recheck(answer: dict) -> dict:
    """`verdict` again from its own answer (the soak JSON's `quarantine` check): each
    class's result, the quarantined ids and the learner's lines about the hostile groups
    (`consumed`) are all in it."""
    per = answer["hostile"].values()
    results = [{k: v for k, v in row.items() if k not in JUDGED} for row in per]
    checked = [tuple(c) for row in per for c in row["consumed"]]
    return verdict(results, set(answer["quarantined"]), checked,
                   by_record=answer["judged_by"] == BY_RECORD)  # fmt: skip
