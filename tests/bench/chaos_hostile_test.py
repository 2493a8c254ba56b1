"""The chaos soak's hostile workers (bench/chaos_hostile.py) against a real controller
service on loopback: mixed version tags are refused (422) and nothing of them is accepted;
hidden tokens are accepted but score 0 and count against the worker; the $0 junk worker
gets work and its made-up log-probs fail the audit the learner runs on its rows."""

import os
import time

import numpy as np

from bench import chaos_hostile
from bridge.contracts.prompt import TextCodec
from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.http.service import ServerOptions, load_or_create_join_secret, serve_controller
from bridge.control.protocol import SamplingParams
from bridge.control.trust import audit
from bridge.model import tiny_model
from bridge.tasks import make_task


def until(what, deadline_s=300.0):  # a liveness bound, not a timing: ~20 s on a quiet box
    end = time.monotonic() + deadline_s
    while not what():
        assert time.monotonic() < end
        time.sleep(0.05)


def test_hostile_workers_are_refused_scored_zero_or_audited_out(tmp_path):
    tok = str(tmp_path / "tok")
    os.makedirs(tok)
    tiny_model.save_tokenizer(tok)
    cfg = ControllerConfig(staleness=4, groups_per_step=4, group_size=2, vocab_size=128,
                           sampling=SamplingParams(max_tokens=6), audit_min_tokens=20,
                           rate_limit_per_s=0.0)  # fmt: skip
    ctl = Controller(cfg, str(tmp_path / "c.db"), make_task("arithmetic"), codec=TextCodec(tok))
    server = serve_controller(ctl, str(tmp_path), ServerOptions(host="127.0.0.1", port=0))
    ctl.publish(0)
    ctl.publish(1)
    secret = load_or_create_join_secret(str(tmp_path))
    classes = ("mixed_tags", "hidden_tokens", "junk")
    workers = chaos_hostile.start(server.url, secret, str(tmp_path), classes)
    try:
        until(lambda: all(sum(w.result["statuses"].values()) >= 1 for w in workers))
    finally:
        results = {w.kind: w.stop() for w in workers}
        server.stop()
    try:
        assert set(results["mixed_tags"]["statuses"]) == {"422"}, results
        assert results["mixed_tags"]["accepted_groups"] == 0
        assert results["hidden_tokens"]["accepted_groups"] >= 1
        assert results["junk"]["accepted_groups"] >= 1
        groups, _ = ctl.take_batch(1, ctl.db.count("buffered"))
        by = {}
        for g in groups:
            by.setdefault(g.worker_id, []).append(g)
        hidden = by[results["hidden_tokens"]["worker_id"]]
        for t in (t for g in hidden for t in g.trajectories):
            assert t.reward == 0.0 and t.reward_error.startswith("HiddenToken"), t
        # The learner's audit on the junk worker's rows (its log-probs vs the policy's):
        # any policy over 128 tokens gives random ids log p far below -0.01.
        junk_id = results["junk"]["worker_id"]
        rows = [t for g in by[junk_id] for t in g.trajectories]
        n = max(len(t.logprobs) for t in rows)
        behaviour, mask = np.zeros((len(rows), n)), np.zeros((len(rows), n))
        for i, t in enumerate(rows):
            behaviour[i, : len(t.logprobs)], mask[i, : len(t.logprobs)] = t.logprobs, 1.0
        learner = np.full_like(behaviour, -np.log(128.0))  # a flat policy, the kindest case
        stats = audit.rows_to_worker_stats([junk_id] * len(rows), [1] * len(rows),
                                           behaviour, learner, mask, 1)  # fmt: skip
        assert ctl.audit(stats) == [junk_id]
        with ctl.lock:  # counted against the worker that sent them
            n_hidden = ctl.workers.hidden_tokens(results["hidden_tokens"]["worker_id"])
        assert n_hidden == sum(len(g.trajectories) for g in hidden)
    finally:
        ctl.close()


def test_in_a_testbed_each_hostile_worker_is_an_identity_of_its_own():
    """Called from one non-loopback address (the testbed's root namespace), the shared secret
    is that host's identity, which one quarantine bans for every attacker there; with
    `credentials` each hostile worker is `cred:hostile-<seed>`, caught on its own."""
    from bridge.control.trust.identity import identity_of

    secret, host = "s3cret", "10.250.1.1"
    shared = chaos_hostile.HostileWorker("junk", "http://x", secret, "/tmp", seed=3)
    assert identity_of(shared.join_secret, [secret], host) == f"host:{host}"
    own = [chaos_hostile.HostileWorker(k, "http://x", secret, "/tmp", seed=i, credential=True)
           for i, k in enumerate(chaos_hostile.CLASSES)]  # fmt: skip
    ids = [identity_of(w.join_secret, [secret], host) for w in own]
    assert ids == [f"cred:hostile-{i}" for i in range(len(own))]
