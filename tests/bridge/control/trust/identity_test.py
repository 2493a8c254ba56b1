"""Quarantine sticks to who registered (issue 23 item 11; bridge/control/trust/identity.py): a
worker quarantined under a per-worker credential cannot register again with it (over real
HTTP on loopback, and after a controller restart), a credential holds one live worker, a
remote host that presented the shared secret is barred once one of its workers is
quarantined, and credentials follow a secret rotation."""

import os

import pytest
from fastapi.testclient import TestClient

from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.http.service import make_app
from bridge.control.intake.validation import SubmissionError
from bridge.control.protocol import SamplingParams, WorkerProfile
from bridge.control.trust import audit
from bridge.control.trust.identity import identity_of, mint_credential
from bridge.control.trust.join_secret import JoinSecret
from bridge.model.tiny_model import EOS_ID, char_vocab
from bridge.tasks import make_task

PROFILE = {"accelerator": "cpu", "price_per_hour": 0.0, "max_concurrent_sequences": 16}


def register(client, presented):
    return client.post("/v1/register", json={"join_secret": presented, "profile": PROFILE})


def bearer(r):
    assert r.status_code == 200, r.text
    return r.json()["worker_id"], {"Authorization": f"Bearer {r.json()['token']}"}


def lease_and_submit(client, headers):
    r = client.post("/v1/lease", headers=headers, json={"worker_version": 0, "max_groups": 1})
    lease = r.json()["lease"]
    group, ids = lease["groups"][0], [char_vocab()["1"], EOS_ID]
    trajs = [
        dict(prompt_id=group["prompt_id"], sample_index=i,
             prompt_token_ids=group["prompt_token_ids"], completion_token_ids=ids,
             logprobs=[-0.5, -0.5], versions=[0, 0], finish_reason="stop")
        for i in range(2)
    ]  # fmt: skip
    body = {"lease_id": lease["lease_id"], "groups": [{"group_id": group["group_id"],
                                                       "trajectories": trajs}]}  # fmt: skip
    assert client.post("/v1/submit", headers=headers, json=body).status_code == 200
    return lease


def dump(ctl):
    with ctl.lock:
        return list(ctl.db.conn.iterdump())


BAD = dict(tokens=400, sum_k3=400 * 3.0, sum_logratio=400 * 4.0)  # past audit_min_tokens


def test_a_quarantined_credential_cannot_register_again(service):
    ctl, server, client, secret, workdir = service
    ctl.publish(0)
    cheat_cred, honest_cred = mint_credential(secret, "gpu-7"), mint_credential(secret, "gpu-8")
    cheat, headers = bearer(register(client, cheat_cred))
    honest, honest_headers = bearer(register(client, honest_cred))
    lease_and_submit(client, headers)
    assert ctl.stats()["groups/buffered"] == 1
    assert ctl.audit([audit.AuditStat(cheat, 0, **BAD)]) == [cheat]
    assert ctl.stats()["groups/buffered"] == 0  # its work requeued, never trained on

    before = dump(ctl)
    r = register(client, cheat_cred)
    assert r.status_code == 403 and "cred:gpu-7 is quarantined" in r.text, r.text
    assert dump(ctl) == before  # no worker id minted, nothing queued or buffered
    forged = cheat_cred.replace("gpu-7", "gpu-9")  # a new name under the old MAC
    assert register(client, forged).status_code == 403
    assert dump(ctl) == before
    assert ctl.take_batch(0, 1)[0] is None
    # The other credential and the operator's local workers (shared secret, loopback) join.
    assert client.post("/v1/heartbeat", headers=honest_headers, json={"worker_version": 0})
    assert register(client, secret).status_code == 200

    ctl.close()  # a restart on the same database keeps the credential barred
    again = Controller(ctl.config, os.path.join(workdir, "controller.db"), ctl.task,
                       codec=ctl.codec)  # fmt: skip
    with pytest.raises(SubmissionError, match="quarantined") as e:
        again.register(WorkerProfile(**PROFILE), "cred:gpu-7")
    assert e.value.status == 403
    again.register(WorkerProfile(**PROFILE), "cred:gpu-8")
    again.close()


def test_one_live_worker_per_credential(service):
    ctl, server, client, secret, _ = service
    ctl.publish(0)
    cred = mint_credential(secret, "box")
    first, old = bearer(register(client, cred))
    lease = client.post("/v1/lease", headers=old, json={"worker_version": 0, "max_groups": 1})
    assert lease.json()["lease"] and ctl.stats()["groups/leased"] == 1
    second, new = bearer(register(client, cred))
    assert second != first
    # The first registration left: token dead, its leased group back in the queue.
    assert client.post("/v1/heartbeat", headers=old, json={"worker_version": 0}).status_code == 401
    assert ctl.stats()["groups/leased"] == 0
    assert client.post("/v1/heartbeat", headers=new, json={"worker_version": 0}).status_code == 200
    live = [w for w in ctl.status()["workers"] if w["state"] != "gone"]
    assert [w["worker_id"] for w in live] == [second]


def test_a_remote_host_is_barred_after_a_quarantine(tmp_path, text_codec):
    ctl = Controller(
        ControllerConfig(staleness=1, groups_per_step=1, group_size=2, vocab_size=100,
                         sampling=SamplingParams(max_tokens=4)),
        os.path.join(tmp_path, "c.db"), make_task("arithmetic"), codec=text_codec,
    )  # fmt: skip
    app = make_app(ctl, "s3cret")
    https = dict(base_url="https://testserver")  # a remote worker over TLS
    remote = TestClient(app, client=("203.0.113.9", 40000), **https)
    other = TestClient(app, client=("198.51.100.4", 40000), **https)
    cheat, _ = bearer(register(remote, "s3cret"))
    assert ctl.audit([audit.AuditStat(cheat, 0, **BAD)]) == [cheat]
    before = dump(ctl)
    r = register(remote, "s3cret")
    assert r.status_code == 403 and "host:203.0.113.9 is quarantined" in r.text
    assert dump(ctl) == before
    assert register(other, "s3cret").status_code == 200
    ctl.close()


def test_credentials_follow_a_rotation(tmp_path):
    path, now = tmp_path / "join_token", [0.0]
    path.write_text("old-secret\n")
    secret = JoinSecret.from_file(str(path), grace_s=60, check_every_s=0, clock=lambda: now[0])
    old_cred = mint_credential("old-secret", "w1")
    assert identity_of(old_cred, secret.accepted(), "203.0.113.9") == "cred:w1"
    path.write_text("new-secret-longer\n")  # another size: the change is noticed
    now[0] = 30.0  # the rotation is noticed now: the old secret is good until 90
    assert identity_of(old_cred, secret.accepted(), "203.0.113.9") == "cred:w1"
    now[0] = 91.0
    assert identity_of(old_cred, secret.accepted(), "203.0.113.9") is None
    new_cred = mint_credential("new-secret-longer", "w1")
    assert identity_of(new_cred, secret.accepted(), "203.0.113.9") == "cred:w1"
    assert identity_of("new-secret-longer", secret.accepted(), "127.0.0.1") == "local"
    assert identity_of("new-secret-longer", secret.accepted(), "203.0.113.9") == "host:203.0.113.9"
    assert identity_of("w1.w1." + "0" * 64, secret.accepted(), "127.0.0.1") is None
