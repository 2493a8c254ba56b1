"""The exact check's counts at the controller: mismatched tokens add up per identity, so a
credential that registers again keeps its count, and the threshold quarantines it; the
operator's loopback workers count per worker id."""

import pytest
from controller_helpers import make

from bridge.control.audit import AuditStat
from bridge.control.protocol import WorkerProfile
from bridge.control.validation import SubmissionError

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
    assert ctl.audit([_exact(second, 100, 1)]) == [second]
    why = ctl.db.quarantined()[second]["why"]
    assert "5 sampled tokens were not the seeded sampler's choice" in why
    with pytest.raises(SubmissionError):
        ctl.register(PROFILE, identity="cred:mallory")  # barred, restarts included
    assert ctl.db.get("audit/exact_tokens") == 300
    assert ctl.db.get("audit/exact_mismatches") == 5
    ctl.close()


def test_honest_counts_quarantine_nobody_and_local_workers_count_alone(tmp_path):
    ctl = make(tmp_path, exact_quarantine_tokens=2)
    a, _ = ctl.register(PROFILE, identity="local")
    b, _ = ctl.register(PROFILE, identity="local")
    assert ctl.audit([_exact(a, 10_000, 0), _exact(b, 10_000, 1)]) == []
    assert ctl.audit([_exact(a, 10, 1)]) == []  # a's own count is 1, b's too
    assert ctl.audit([_exact(b, 10, 1)]) == [b]
    ctl.close()
