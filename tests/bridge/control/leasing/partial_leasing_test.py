"""The controller's side of partial rollouts (`rollout.partial=continue`) and of a dropped
group's requeue.

- A continued group (tokens of several versions) is judged by its newest token within the
  cap S_max + 1 (bridge/contracts/staleness.py `group_version`): kept where "off" drops it,
  dropped once its oldest token is past the cap.
- With "continue" a worker too slow for the bound still gets leases (it continues under the
  newer versions instead of coming back stale), and each lease says "continue".
- A group dropped as stale is not leased again to the worker that returned it late while
  another worker asks for work; a worker alone still gets it back (controller_test.py).
"""

from controller_helpers import Clock, make, submit_all, worker

from bridge.contracts import staleness as staleness_rule
from bridge.control.protocol import LeaseRequest


def test_group_version_is_the_oldest_token_or_the_newest_within_the_cap():
    assert staleness_rule.group_version(3, 7, "off", 2) == 3
    assert staleness_rule.group_version(3, 5, "continue", 2) == 5
    assert staleness_rule.group_version(3, 7, "continue", 2) == 6  # 3 + S_max + 1
    assert staleness_rule.versions_kept(2, "off") == 4
    assert staleness_rule.versions_kept(2, "continue") == 7  # tokens up to 2 S_max + 1 old


def _one_group_through(tmp_path, partial, versions, step):
    """One worker's one group, leased at version `versions[0]`, submitted with `versions`
    after versions up to `max(versions)` were published; the learner then asks at `step`."""
    tmp_path.mkdir()
    ctl = make(tmp_path, staleness=1, groups_per_step=1, max_groups_per_lease=1, partial=partial)
    ctl.publish(versions[0])
    w = worker(ctl)
    lease = ctl.lease(w, LeaseRequest(worker_version=versions[0], max_groups=1)).lease
    assert lease.partial == partial
    for v in range(versions[0] + 1, max(versions) + 1):
        ctl.publish(v)
    submit_all(ctl, w, lease, versions=versions)
    batch, stats = ctl.take_batch(step, 1)
    ctl.close()
    return batch, stats


def test_a_continued_group_is_judged_by_its_newest_token_within_the_cap(tmp_path):
    # S = 1, step 3: a group whose tokens run from version 0 to 2. Judged by its oldest
    # token (off) it is 3 versions old: dropped. Continued, by its newest: 1 old, kept.
    batch, stats = _one_group_through(tmp_path / "off", "off", (0, 2, 2), 3)
    assert batch is None and stats["staleness/dropped"] == 1
    batch, stats = _one_group_through(tmp_path / "on", "continue", (0, 2, 2), 3)
    assert batch is not None and stats["staleness/dropped"] == 0
    # staleness/max reports the oldest token's lag, what the correction has to carry
    assert stats["staleness/max"] == 3
    # tokens 0..3 at step 4: the cap (oldest + S_max + 1 = 2) judges it 2 old: dropped
    batch, stats = _one_group_through(tmp_path / "cap", "continue", (0, 3, 3), 4)
    assert batch is None and stats["staleness/dropped"] == 1


def test_with_continue_a_worker_too_slow_for_the_bound_still_gets_leases(tmp_path):
    for partial, expect in (("off", "too_slow"), ("continue", "ok")):
        clock = Clock()
        (tmp_path / partial).mkdir()
        ctl = make(
            tmp_path / partial, clock, staleness=1, groups_per_step=1, max_groups_per_lease=1,
            retest_slow_after_s=100.0, partial=partial,
        )  # fmt: skip
        ctl.publish(0)
        slow, fast = worker(ctl), worker(ctl)
        slow_lease = ctl.lease(slow, LeaseRequest(worker_version=0)).lease
        for step in range(5):  # the fast worker feeds the learner; each step takes 1.1 s
            lease = ctl.lease(fast, LeaseRequest(worker_version=step)).lease
            clock.t += 0.1
            submit_all(ctl, fast, lease, versions=(step,) * 3)
            assert ctl.take_batch(step, 1)[0] is not None
            clock.t += 1.0
            ctl.publish(step + 1)
        submit_all(ctl, slow, slow_lease)  # 5.5 s after its lease, all of version 0: late
        r = ctl.lease(slow, LeaseRequest(worker_version=5))
        assert r.reason == expect, (partial, r.reason)
        ctl.close()


def test_a_dropped_group_goes_to_another_worker_not_back_to_the_late_one(tmp_path):
    ctl = make(tmp_path, staleness=1, groups_per_step=1, max_groups_per_lease=1)
    ctl.publish(0)
    late, other = worker(ctl), worker(ctl)
    # the other worker is around: it asked for work (and was refused: nothing is published
    # for its version yet)
    ctl.lease(other, LeaseRequest(worker_version=-1, max_groups=1))
    lease = ctl.lease(late, LeaseRequest(worker_version=0, max_groups=1)).lease
    (dropped,) = [g.prompt_id for g in lease.groups]
    for v in (1, 2):
        ctl.publish(v)
    submit_all(ctl, late, lease, versions=(0, 0, 0))
    assert ctl.take_batch(2, 1)[0] is None and ctl.stats()["staleness/dropped"] == 1
    # the group is back at the front of the queue; the late worker asks first, again
    again = ctl.lease(late, LeaseRequest(worker_version=2, max_groups=1)).lease
    assert [g.prompt_id for g in again.groups] != [dropped]
    taken = ctl.lease(other, LeaseRequest(worker_version=2, max_groups=1)).lease
    assert [g.prompt_id for g in taken.groups] == [dropped]
    ctl.close()
