"""Quarantine and audit evidence live in the controller's SQLite database: a controller
restarted on the same file keeps a quarantined worker locked out, and a worker's audit
evidence gathered before the restart still counts after it.

That the quarantined party cannot register again (its credential or remote host is barred,
restarts included) is identity_test.py.
"""

from controller_helpers import Clock, make, submit_all, worker

from bridge.control.protocol import LeaseRequest, WorkerProfile
from bridge.control.trust import audit

PROFILE = WorkerProfile(accelerator="cpu", price_per_hour=2.0, max_concurrent_sequences=64)


def test_a_restart_keeps_a_quarantined_worker_quarantined(tmp_path):
    clock = Clock()
    cfg = dict(audit_min_tokens=20)
    ctl = make(tmp_path, clock, **cfg)
    ctl.publish(0)
    cheat, token = ctl.register(PROFILE)
    honest = worker(ctl)
    lease = ctl.lease(cheat, LeaseRequest(worker_version=0, max_groups=1)).lease
    assert submit_all(ctl, cheat, lease).accepted
    bad = audit.AuditStat(cheat, 0, tokens=40, sum_k3=40 * 3.0, sum_logratio=40 * 4.0)
    assert ctl.audit([bad]) == [cheat]
    assert ctl.authenticate(token) is None
    ctl.close()

    again = make(tmp_path, clock, **cfg)  # the same ctl.db file
    assert again.authenticate(token) is None  # still revoked: 401 over HTTP
    states = {w["worker_id"]: w["state"] for w in again.status()["workers"]}
    assert states[cheat] == "quarantined" and states[honest] == "active"
    assert again.stats()["fleet/quarantined"] == 1
    assert set(again.db.quarantined()) == {cheat}
    assert again.audit([bad]) == []  # not quarantined (or counted) a second time
    assert again.stats()["fleet/quarantined"] == 1
    assert again.db.groups_in("buffered") == []  # its accepted work never reaches training


def test_audit_evidence_survives_a_restart(tmp_path):
    clock = Clock()
    cfg = dict(audit_min_tokens=20)
    ctl = make(tmp_path, clock, **cfg)
    w = worker(ctl)
    # Far from the learner, but below audit_min_tokens: no verdict yet.
    half = audit.AuditStat(w, 0, tokens=15, sum_k3=15 * 3.0, sum_logratio=15 * 4.0)
    assert ctl.audit([half]) == []
    before = ctl.auditor.score(w)
    ctl.close()

    again = make(tmp_path, clock, **cfg)
    assert again.auditor.score(w) == before  # the decayed sums were kept
    # 15 + 15 tokens pass audit_min_tokens only if the first 15 were remembered.
    assert again.audit([half]) == [w]
    assert again.status()["run"]["workers"]["quarantined"] == 1


def test_sampling_evidence_judges_before_min_tokens_and_survives_a_restart(tmp_path):
    """The sampling check's evidence CUSUM (bridge/contracts/sampling_check.py): a picker
    whose stats carry positive evidence is quarantined past audit_sampling_evidence long
    before audit_min_tokens; an honest worker's negative evidence never accumulates (the
    CUSUM resets at 0, so it banks no credit either); a restart keeps the CUSUM."""
    clock = Clock()
    cfg = dict(audit_min_tokens=256, audit_sampling_evidence=23.0)
    ctl = make(tmp_path, clock, **cfg)
    picker, honest = worker(ctl), worker(ctl)

    def stat(w, evidence):  # 4 tokens of true log-probs (k3 0), Z inside its bound
        return audit.AuditStat(w, 0, tokens=4, sum_k3=0.0, sum_logratio=0.0, sum_dev=0.5,
                               sum_var=1.0, sum_evidence=evidence)  # fmt: skip

    for _ in range(50):  # an honest past: a deep negative sum, reset to 0 each time
        assert ctl.audit([stat(honest, -2.0), stat(picker, -2.0)]) == []
    for _ in range(4):  # 4 x 4.0 = 16 < 23: no verdict yet
        assert ctl.audit([stat(picker, 4.0)]) == []
    assert ctl.auditor.score(picker)["sampling_evidence"] == 16.0
    ctl.close()
    again = make(tmp_path, clock, **cfg)
    assert again.audit([stat(picker, 4.0)]) == []  # 20
    assert again.audit([stat(picker, 4.0), stat(honest, -2.0)]) == [picker]  # 24 >= 23
    assert again.auditor.score(picker)["tokens"] < 256
    assert again.auditor.score(honest)["sampling_evidence"] == 0.0
