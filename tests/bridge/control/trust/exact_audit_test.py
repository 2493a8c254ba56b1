"""The exact check's counts at the controller: mismatched tokens add up per identity, so a
credential that registers again keeps its count, and the threshold quarantines it; the
operator's loopback workers count per worker id."""

import pytest
from controller_helpers import make

from bridge.control.intake.validation import SubmissionError
from bridge.control.protocol import WorkerProfile
from bridge.control.trust.audit import AuditStat

PROFILE = WorkerProfile(accelerator="cpu", price_per_hour=1.0, max_concurrent_sequences=8)


def _exact(worker_id, checked, bad):
    return AuditStat(worker_id=worker_id, version=0, tokens=0, sum_k3=0.0, sum_logratio=0.0,
                     exact_tokens=checked, exact_mismatches=bad)  # fmt: skip


def test_mismatches_add_up_per_credential_across_registrations(tmp_path):
    ctl = make(tmp_path, exact_quarantine_tokens=5)
    first, _ = ctl.register(PROFILE, identity="cred:mallory")
    assert ctl.audit([_exact(first, 100, 3)]) == []
    # the credential registers again (its first id is superseded): the count stays
    second, _ = ctl.register(PROFILE, identity="cred:mallory")
    assert ctl.audit([_exact(second, 100, 1)]) == []
    assert ctl.audit([_exact(second, 100, 1)]) == [second, first]  # the earlier id too
    why = ctl.db.quarantined()[second]["why"]
    assert "5 of 300 checked tokens were not the seeded sampler's choice" in why
    with pytest.raises(SubmissionError):
        ctl.register(PROFILE, identity="cred:mallory")  # barred, restarts included
    assert ctl.db.get("audit/exact_tokens") == 300
    assert ctl.db.get("audit/exact_bad") == 5
    ctl.close()


def test_a_quarantine_takes_every_id_of_the_credential(tmp_path):
    ctl = make(tmp_path, exact_quarantine_tokens=5)
    old, _ = ctl.register(PROFILE, identity="cred:mallory")
    live, token = ctl.register(PROFILE, identity="cred:mallory")  # supersedes `old`
    other, _ = ctl.register(PROFILE, identity="cred:alice")
    # the learner checks `old`'s groups late, after the credential registered again: the
    # live id (its token, its leases and buffered groups) goes with it, no other party
    assert ctl.audit([_exact(old, 100, 5)]) == [old, live]
    assert ctl.workers.authenticate(token) is None
    assert "a worker of cred:mallory was quarantined" in ctl.db.quarantined()[live]["why"]
    assert other not in ctl.db.quarantined()
    ctl.close()


def test_local_workers_count_alone_and_a_rare_mismatch_needs_the_fraction(tmp_path):
    ctl = make(tmp_path, exact_quarantine_tokens=2, exact_quarantine_fraction=0.01)
    a, _ = ctl.register(PROFILE, identity="local")
    b, _ = ctl.register(PROFILE, identity="local")
    assert ctl.audit([_exact(a, 100, 0), _exact(b, 100, 1)]) == []
    assert ctl.audit([_exact(a, 10, 1)]) == []  # a's own count is 1, b's too
    assert ctl.audit([_exact(b, 10, 1)]) == [b]  # 2 of 110
    # 2 mismatches in 10,000 tokens are under 1%: not yet; 100 more are
    c, _ = ctl.register(PROFILE, identity="cred:c")
    assert ctl.audit([_exact(c, 10_000, 2)]) == []
    assert ctl.audit([_exact(c, 100, 100)]) == [c]
    ctl.close()


def test_the_rule_and_its_false_alarm_bound():
    from bridge.contracts import exact_check

    assert not exact_check.quarantines(7, 10, tokens=8, fraction=0.01)
    assert exact_check.quarantines(8, 800, tokens=8, fraction=0.01)
    assert not exact_check.quarantines(8, 801, tokens=8, fraction=0.01)
    assert not exact_check.quarantines(10**6, 10**6, tokens=0)
    # an honest rate of 1e-4 per token: reached with probability < 1e-9, however long
    # the identity works; a rate at the fraction itself: surely
    assert exact_check.false_quarantine_bound(1e-4) < 1e-9
    assert exact_check.false_quarantine_bound(0.05) > 0.99


def _statistical(worker_id, tokens, mean_k3):
    return AuditStat(worker_id=worker_id, version=0, tokens=tokens,
                     sum_k3=mean_k3 * tokens, sum_logratio=0.0)  # fmt: skip


def test_the_statistical_evidence_adds_up_per_credential_too(tmp_path):
    """A credential that registers again before any of its ids reaches `min_tokens` (256)
    keeps its audited tokens: 200 far-off tokens under each of two ids are judged as 400
    of one party. The operator's loopback workers are judged one id at a time."""
    ctl = make(tmp_path, audit_min_tokens=256)
    first, _ = ctl.register(PROFILE, identity="cred:mallory")
    assert ctl.audit([_statistical(first, 200, 0.5)]) == []
    second, _ = ctl.register(PROFILE, identity="cred:mallory")
    assert ctl.audit([_statistical(second, 200, 0.5)]) == [second, first]
    assert "mean k3 0.5 per token" in ctl.db.quarantined()[second]["why"]
    a, _ = ctl.register(PROFILE, identity="local")
    b, _ = ctl.register(PROFILE, identity="local")
    assert ctl.audit([_statistical(a, 200, 0.5), _statistical(b, 200, 0.5)]) == []
    ctl.close()
