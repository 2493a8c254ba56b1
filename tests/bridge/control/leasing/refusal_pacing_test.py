"""A full admission window (bridge/control/leasing/refusal_pacing.py): refused workers are told to
ask again after `retry_after_s` plus a delay spread over the idle fleet at
`lease_retry_budget_per_s`, so a fleet larger than the window does not storm."""

from controller_helpers import Clock, make, worker

from bridge.control.protocol import LeaseRequest


def full_window(tmp_path, **cfg):
    """S=0, one group per step: one leased group fills the window."""
    clock = Clock()
    ctl = make(tmp_path, clock, staleness=0, groups_per_step=1, max_groups_per_lease=1,
               register_burst=1000.0, lease_ttl_s=100.0, **cfg)  # fmt: skip
    ctl.publish(0)
    filler = worker(ctl)
    assert ctl.lease(filler, LeaseRequest(worker_version=0, max_groups=1)).lease is not None
    return clock, ctl


def test_full_refusals_are_spread_over_the_idle_fleet(tmp_path):
    clock, ctl = full_window(tmp_path, lease_retry_budget_per_s=10.0, retry_after_s=0.5)
    idle = [worker(ctl) for _ in range(50)]
    first = [ctl.lease(w, LeaseRequest(worker_version=0)) for w in idle]
    assert {r.reason for r in first} == {"full"}
    # The count of waiting workers is taken at most once a second: 1 at the first refusal.
    assert all(0.5 <= r.retry_after_s <= 0.5 + 1 / 10.0 for r in first)
    clock.t += 1.0  # 50 workers now wait: a 5 s spread
    retries = [ctl.lease(w, LeaseRequest(worker_version=0)).retry_after_s for w in idle]
    assert min(retries) >= 0.5 and max(retries) <= 0.5 + 50 / 10.0
    assert max(retries) - min(retries) > 2.5  # spread, not all at once (50 draws)
    # Workers that stop asking stop counting (after worker_timeout_s): back to the base.
    clock.t += ctl.config.worker_timeout_s + 1.0
    r = ctl.lease(idle[0], LeaseRequest(worker_version=0))
    assert r.reason == "full" and 0.5 <= r.retry_after_s <= 0.5 + 1 / 10.0


def test_a_worker_holding_all_it_may_is_told_the_base_retry(tmp_path):
    """ "full" for the worker's own cap (room opens when it submits): no spread."""
    ctl = make(tmp_path, Clock(), staleness=3, groups_per_step=1, max_groups_per_lease=1,
               lease_retry_budget_per_s=0.001, lease_ttl_s=100.0)  # fmt: skip
    ctl.publish(0)
    w = worker(ctl, max_seqs=2)  # group_size 2: one group at a time
    assert ctl.lease(w, LeaseRequest(worker_version=0)).lease is not None
    r = ctl.lease(w, LeaseRequest(worker_version=0))
    assert r.reason == "full" and r.retry_after_s == ctl.config.retry_after_s


def test_with_no_budget_the_base_retry(tmp_path):
    _, ctl = full_window(tmp_path, lease_retry_budget_per_s=0.0)
    r = ctl.lease(worker(ctl), LeaseRequest(worker_version=0))
    assert r.reason == "full" and r.retry_after_s == ctl.config.retry_after_s
