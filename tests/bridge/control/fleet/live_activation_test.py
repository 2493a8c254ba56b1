"""Cost-aware activation in the live fleet plan (bridge/control/fleet/fleet_plan.py): the cheapest
covering set, standby billing, hysteresis, activation off; a real Controller on a temp SQLite
file with an injected clock (fleet_plan_test.py's helpers)."""

import pytest
from fleet_plan_test import Clock, hb, make, run_lease, worker

from bridge.control.fleet import activation
from bridge.control.protocol import LeaseRequest
from bridge.control.trust import audit


def four_workers(tmp_path, text_codec, clock, **cfg):
    """A cheap-and-fast pair (a, b), a pricey fast one (c), a cheap slow one (d), measured and
    audited; the learner needs R / T = 4 rollouts/s (4.4 with the margin)."""
    ctl = make(tmp_path, text_codec, clock, activation_period_s=30.0, **cfg)
    ctl.publish(0)
    a, b, c, d = (worker(ctl, p) for p in (1.0, 1.0, 3.0, 0.5))
    run_lease(ctl, clock, a, groups=3, seconds=2.0)  # 3 rollouts/s
    run_lease(ctl, clock, b, groups=2, seconds=2.0)  # 2
    run_lease(ctl, clock, c, groups=5, seconds=2.0)  # 5
    run_lease(ctl, clock, d, groups=1, seconds=4.0)  # 0.5
    # Each one's own audited work vouches for its speed (audit.vouches).
    ctl.audit([audit.AuditStat(w, 0, tokens=ctl.config.audit_min_tokens, sum_k3=0.0,
                               sum_logratio=0.0) for w in (a, b, c, d)])  # fmt: skip
    ctl.report_learner(step_s=1.0)
    return ctl, (a, b, c, d)


def test_activation_picks_the_cheapest_cover_and_bills_standby_at_its_price(tmp_path, text_codec):
    clock = Clock()
    cfg = dict(activation=True, standby_price_fraction=0.25)
    ctl, (a, b, c, d) = four_workers(tmp_path, text_codec, clock, **cfg)
    active = {w: hb(ctl, w).active for w in (a, b, c, d)}  # the first heartbeat re-solves
    assert active == {a: True, b: True, c: False, d: False}
    refused = ctl.lease(c, LeaseRequest(worker_version=0, max_groups=1))
    assert refused.lease is None and refused.reason == "inactive"
    assert ctl.lease(a, LeaseRequest(worker_version=0, max_groups=1)).lease is not None
    s = ctl.stats()
    assert s["fleet/active_workers"] == 2 and s["fleet/standby_workers"] == 2
    assert s["capacity/active_rollouts_per_s"] == pytest.approx(5.0)
    before = s["cost/usd"]
    clock.t += 10
    for w in (a, b, c, d):
        hb(ctl, w)
    s = ctl.stats()
    assert s["cost/usd"] - before == pytest.approx((2 * 1.0 + 0.25 * (3.0 + 0.5)) * 10 / 3600)
    accepted = s["trajectories/accepted"]
    assert s["cost/usd_per_1k_rollouts"] == pytest.approx(1000 * s["cost/usd"] / accepted)

    # A newcomer is unmeasured: it stays active so it can be measured.
    e = worker(ctl, 9.0)
    assert hb(ctl, e).active and ctl.stats()["fleet/active_workers"] == 3

    # The set survives a controller restart.
    ctl.close()
    ctl = make(tmp_path, text_codec, clock, **cfg)
    assert not hb(ctl, c).active and hb(ctl, a).active


def test_an_active_worker_leaving_activates_a_standby_one(tmp_path, text_codec):
    clock = Clock()
    ctl, (a, b, c, d) = four_workers(tmp_path, text_codec, clock, activation=True)
    assert not hb(ctl, c).active
    ctl.leave(a)  # b alone (2/s) no longer covers 4.4: c (5/s) is the cheapest cover
    assert {w: hb(ctl, w).active for w in (b, c, d)} == {b: False, c: True, d: False}
    assert ctl.lease(c, LeaseRequest(worker_version=0, max_groups=1)).lease is not None


def test_speed_jitter_does_not_flip_the_set(tmp_path, text_codec):
    clock = Clock()
    ctl, (a, b, c, d) = four_workers(tmp_path, text_codec, clock, activation=True)
    assert [hb(ctl, w).active for w in (a, b, c, d)] == [True, True, False, False]
    run_lease(ctl, clock, a, groups=2, seconds=2.4)  # a: 10 rollouts in 4.4 s = 2.27/s
    clock.t += 30  # past activation_period_s: the next heartbeat re-solves
    assert [hb(ctl, w).active for w in (a, b, c, d)] == [True, True, False, False]
    # Without hysteresis the optimum would have moved (a + b = 4.27 < 4.4: add d).
    offers = [
        activation.Offer(w, p, mu)
        for w, p, mu in ((a, 1.0, 10 / 4.4), (b, 1.0, 2.0), (c, 3.0, 5.0), (d, 0.5, 0.5))
    ]
    assert activation.decide(offers, 4.0, 0.1).active == {a, b, d}
    ctl.flush_hot(expire=False)  # the heartbeats' contacts, for a solve called directly
    assert ctl.fleet.replan(clock(), force=True).kept_previous


def test_activation_off_keeps_everyone_active_and_billed_in_full(tmp_path, text_codec):
    clock = Clock()
    ctl, workers = four_workers(tmp_path, text_codec, clock, standby_price_fraction=0.25)
    assert all(hb(ctl, w).active for w in workers)
    assert all(ctl.lease(w, LeaseRequest(worker_version=0)).lease for w in workers)
    s = ctl.stats()
    assert s["fleet/active_workers"] == 4 and s["fleet/standby_workers"] == 0
    before = s["cost/usd"]
    clock.t += 10
    for w in workers:
        hb(ctl, w)
    assert ctl.stats()["cost/usd"] - before == pytest.approx(5.5 * 10 / 3600)
