"""Leases and activation on measured facts (issue 23 item 9; bridge/control/leasing/lease_caps.py,
audit.vouches), over real HTTP on loopback with the controller's clock injected: a worker
declaring a huge concurrency holds one lease's worth of groups, not the prompt queue; its
heartbeats do not keep a lease alive past the age cap from the fleet's measured latency
(its groups go to an honest worker, nothing of it reaches a batch); and a $0 worker that
returns work fast does not put the honest fleet on standby before the audit vouches for it.
"""

import os

import httpx
import pytest
from controller_helpers import Clock

from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.http.service import ServerOptions, load_or_create_join_secret, serve_controller
from bridge.control.protocol import SamplingParams
from bridge.control.trust import audit
from bridge.model.tiny_model import EOS_ID, char_vocab
from bridge.tasks import make_task


@pytest.fixture
def live(tmp_path, text_codec, request):
    clock = Clock()
    cfg = dict(staleness=1, groups_per_step=8, group_size=2, vocab_size=100, lease_ttl_s=60.0,
               max_groups_per_lease=4, sampling=SamplingParams(max_tokens=4))  # fmt: skip
    cfg.update(getattr(request, "param", {}))
    ctl = Controller(ControllerConfig(**cfg), os.path.join(tmp_path, "c.db"),
                     make_task("arithmetic"), clock, codec=text_codec)  # fmt: skip
    server = serve_controller(ctl, str(tmp_path), ServerOptions())
    secret = load_or_create_join_secret(str(tmp_path))
    with httpx.Client(base_url=server.url, timeout=30) as client:

        def join(price=1.0, sequences=16):
            profile = {"accelerator": "cpu", "price_per_hour": price,
                       "max_concurrent_sequences": sequences}  # fmt: skip
            r = client.post("/v1/register", json={"join_secret": secret, "profile": profile})
            return r.json()["worker_id"], {"Authorization": f"Bearer {r.json()['token']}"}

        yield ctl, clock, client, join
    server.stop()
    ctl.close()


def lease(client, headers, groups):
    r = client.post("/v1/lease", headers=headers, json={"worker_version": 0, "max_groups": groups})
    assert r.status_code == 200, r.text
    return r.json()["lease"], r.json()["reason"]


def submit(client, headers, got):
    ids = [char_vocab()["1"], EOS_ID]
    groups = [
        {"group_id": g["group_id"], "trajectories": [
            dict(prompt_id=g["prompt_id"], sample_index=i, prompt_token_ids=g["prompt_token_ids"],
                 completion_token_ids=ids, logprobs=[-0.5, -0.5], versions=[0, 0],
                 finish_reason="stop") for i in range(2)]}
        for g in got["groups"]
    ]  # fmt: skip
    return client.post("/v1/submit", headers=headers,
                       json={"lease_id": got["lease_id"], "groups": groups})  # fmt: skip


def heartbeat(client, headers):
    r = client.post("/v1/heartbeat", headers=headers, json={"worker_version": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_hoarder_holds_one_lease_and_not_for_ever(live):
    ctl, clock, client, join = live
    ctl.publish(0)
    _, hoarder = join(price=0.0, sequences=10**6)  # declares a million sequences
    first, _ = lease(client, hoarder, 4)
    assert len(first["groups"]) == 4
    again, reason = lease(client, hoarder, 4)  # before: 3 more leases, the whole queue
    assert again is None and reason == "full"
    _, honest = join()
    # Unmeasured, its lease lives at most 20 x lease_ttl_s (1200 s), heartbeats or not.
    for _ in range(23):
        clock.t += 50.0
        assert heartbeat(client, hoarder)["renewed_leases"] == [first["lease_id"]]
        heartbeat(client, honest)
    clock.t += 60.0  # 1210 s old
    assert heartbeat(client, hoarder)["renewed_leases"] == []  # not renewed: ends at the
    back, _ = lease(client, honest, 4)  # next sweep; the hoarded prompts, first in the queue
    assert ctl.db.get("leases/too_old") == 1
    assert {g["group_id"] for g in back["groups"]} == {g["group_id"] for g in first["groups"]}
    # Measured (one lease back in 5 s), a worker's lease lives 4 x 5 s, at least 3 x
    # lease_ttl_s: 180 s.
    clock.t += 5.0
    assert submit(client, hoarder, first).status_code == 409  # requeued: not its any more
    got, _ = lease(client, hoarder, 1)
    clock.t += 5.0
    assert submit(client, hoarder, got).json()["accepted"]
    held, _ = lease(client, hoarder, 4)
    for _ in range(3):
        clock.t += 50.0
        assert heartbeat(client, hoarder)["renewed_leases"] == [held["lease_id"]]
    clock.t += 40.0  # 190 s old
    assert heartbeat(client, hoarder)["renewed_leases"] == []
    assert submit(client, hoarder, held).status_code == 409
    # Nothing it held too long reached the buffer: only its one returned group and the
    # honest worker's lease (not yet submitted) exist.
    assert ctl.stats()["groups/buffered"] == 1


@pytest.mark.parametrize("live", [dict(activation=True, groups_per_step=2, staleness=20,
                                       audit_min_tokens=20, worker_timeout_s=100.0)],
                         indirect=True)  # fmt: skip
def test_a_free_worker_does_not_take_the_fleet_before_it_is_audited(live):
    ctl, clock, client, join = live
    ctl.publish(0)
    honest_id, honest = join(price=1.0)
    junk_id, junk = join(price=0.0)
    for who, seconds in ((honest, 1.0), (junk, 1.0)):  # each: 4 groups = 8 rollouts/s
        got, _ = lease(client, who, 4)
        clock.t += seconds
        assert len(submit(client, who, got).json()["accepted"]) == 4
    ctl.report_learner(step_s=1.0)  # the learner needs 2 x 2 rollouts/s (4.4 with margin)
    fine = audit.AuditStat(honest_id, 0, tokens=40, sum_k3=40e-6, sum_logratio=0.0)
    assert ctl.audit([fine]) == []  # the run audits: the honest worker is vouched for
    clock.t += 31.0  # past activation_period_s
    # Before: the $0 worker alone covered the need and the honest one went to standby.
    assert heartbeat(client, honest)["active"] and heartbeat(client, junk)["active"]
    assert ctl.db.fleet_row(honest_id)["standby"] == 0
    # Once the audit vouches for it too, the cheapest cover is the $0 worker alone.
    ok = audit.AuditStat(junk_id, 0, tokens=40, sum_k3=40e-6, sum_logratio=0.0)
    assert ctl.audit([ok]) == []
    clock.t += 31.0
    assert not heartbeat(client, honest)["active"] and heartbeat(client, junk)["active"]


@pytest.mark.parametrize("live", [dict(activation=True, groups_per_step=2, staleness=20,
                                       audit_min_tokens=20, worker_timeout_s=100.0)],
                         indirect=True)  # fmt: skip
def test_before_any_audit_a_free_worker_displaces_nobody(live):
    """Nobody is vouched for before the run's first audit: a $0 worker that returned one
    instant lease does not put the honest worker on standby, and once only the honest one
    is audited its speed alone counts (the unaudited one stays active, unmeasured)."""
    ctl, clock, client, join = live
    ctl.publish(0)
    honest_id, honest = join(price=1.0)
    junk_id, junk = join(price=0.0)
    got, _ = lease(client, honest, 4)
    clock.t += 1.0  # 8 rollouts/s
    assert len(submit(client, honest, got).json()["accepted"]) == 4
    got, _ = lease(client, junk, 4)  # returned at once: junk, fast
    clock.t += 0.01
    assert len(submit(client, junk, got).json()["accepted"]) == 4
    ctl.report_learner(step_s=1.0)  # the learner needs 4.4 rollouts/s with the margin
    clock.t += 31.0  # past activation_period_s; no audit has run
    # Before: everyone counted as vouched for, and the $0 worker alone covered the need.
    assert heartbeat(client, honest)["active"] and heartbeat(client, junk)["active"]
    assert ctl.db.fleet_row(honest_id)["standby"] == 0
    fine = audit.AuditStat(honest_id, 0, tokens=40, sum_k3=40e-6, sum_logratio=0.0)
    assert ctl.audit([fine]) == []
    clock.t += 31.0
    assert heartbeat(client, honest)["active"] and heartbeat(client, junk)["active"]
    assert ctl.stats()["fleet/standby_workers"] == 0
    assert ctl.db.fleet_row(junk_id)["standby"] == 0
