"""The routing check's sums at the controller: a MoE worker's recorded experts that differ
from the learner's own past the threshold quarantine its identity (the sums add up per
credential across registrations); an honest engine's rate, near-tie flips only, never
does; nothing is judged before `audit_routing_min_rows`."""

from controller_helpers import make

from bridge.contracts import routing
from bridge.control.protocol import WorkerProfile
from bridge.control.trust.audit import AuditStat, row_sums_to_worker_stats

PROFILE = WorkerProfile(accelerator="cpu", price_per_hour=1.0, max_concurrent_sequences=8)


def _routing(worker_id, rows, agree_fraction):
    return AuditStat(worker_id=worker_id, version=0, tokens=0, sum_k3=0.0, sum_logratio=0.0,
                     routing_rows=rows, routing_agree=rows * agree_fraction)  # fmt: skip


def test_forged_routing_quarantines_its_credential_honest_never(tmp_path):
    ctl = make(tmp_path, audit_routing_min_rows=1000)
    honest, _ = ctl.register(PROFILE, identity="cred:alice")
    forger, _ = ctl.register(PROFILE, identity="cred:mallory")
    # An honest engine disagrees at the measured bf16 rate; a forger's records are drawn
    # at random: k of E experts overlap the true ones by k/E (tiny MoE: 2 of 8).
    honest_agree = 1.0 - routing.HONEST_BF16_RATE
    assert ctl.audit([_routing(honest, 600, honest_agree), _routing(forger, 600, 0.25)]) == []
    again, _ = ctl.register(PROFILE, identity="cred:mallory")  # the sums stay with it
    assert ctl.audit([_routing(honest, 600, honest_agree), _routing(again, 600, 0.25)]) == [
        again,
        forger,
    ]
    why = ctl.db.quarantined()[again]["why"]
    assert "recorded MoE routing far from the learner's own: 75.00% of 1200" in why
    assert honest not in ctl.db.quarantined()
    for _ in range(20):  # an honest worker's evidence only ever stays at its rate
        assert ctl.audit([_routing(honest, 5000, honest_agree)]) == []
    ctl.close()


def test_threshold_zero_is_off(tmp_path):
    ctl = make(tmp_path, audit_routing_threshold=0.0, audit_routing_min_rows=10)
    w, _ = ctl.register(PROFILE, identity="cred:x")
    assert ctl.audit([_routing(w, 10_000, 0.0)]) == []
    ctl.close()


def test_row_sums_carry_routing_per_worker_on_policy_rows_only():
    stats = row_sums_to_worker_stats(
        ["a", "a", "b", "b"], [True, True, True, False], [0.0] * 4, [0.0] * 4,
        [5, 5, 5, 5], version=3, row_routing_agree=[10.0, 8.0, 4.0, 9.0],
        row_routing_rows=[10.0, 10.0, 10.0, 10.0],
    )  # fmt: skip
    by = {s.worker_id: s for s in stats}
    assert (by["a"].routing_agree, by["a"].routing_rows) == (18.0, 20.0)
    assert (by["b"].routing_agree, by["b"].routing_rows) == (4.0, 10.0)  # off-policy row out
