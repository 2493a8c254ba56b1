"""bench/staleness_bias.py's reading of a controller database (the runs themselves are the
bench). A real controller on SQLite: a slow worker's long group is dropped as stale twice and
never consumed, a fast worker's short groups are consumed, one prompt is drawn and never
leased; `read_cell` must sort each into its fate with the right lengths and rewards."""

import json

import pytest
from controller_helpers import Clock, make, result

from bench import staleness_bias
from bridge.control.protocol import LeaseRequest, Submission, WorkerProfile


def named_worker(ctl, name):
    wid, _ = ctl.register(
        WorkerProfile(accelerator="cpu", price_per_hour=1.0, max_concurrent_sequences=64, name=name)
    )
    return wid


def submit(ctl, wid, lease, length, version):
    groups = [result(g, versions=(version,) * length) for g in lease.groups]
    ctl.submit(wid, Submission(lease_id=lease.lease_id, groups=groups))


def test_read_cell_sorts_groups_by_fate(tmp_path):
    clock = Clock()
    ctl = make(tmp_path, clock, staleness=0, groups_per_step=1, max_groups_per_lease=1)
    slow, fast = named_worker(ctl, "pool-b-1"), named_worker(ctl, "pool-a-0")
    for step in (0, 1):  # the fast worker's short groups are consumed
        ctl.publish(step)
        lease = ctl.lease(fast, LeaseRequest(worker_version=step, max_groups=1)).lease
        submit(ctl, fast, lease, length=2, version=step)
        assert ctl.take_batch(step, 1)[0] is not None
    ctl.publish(2)
    # The fast worker stops asking for work: the slow one, alone now, gets a group it
    # dropped back (with another worker asking, that one would take it: leasing.py).
    clock.t += 11.0  # > lease_ttl_s
    late = ctl.lease(slow, LeaseRequest(worker_version=2, max_groups=1)).lease
    for step in (3, 4):  # the slow worker's long group comes back stale, twice
        ctl.publish(step)
        submit(ctl, slow, late, length=4, version=step - 1)
        assert ctl.take_batch(step, 1)[0] is None and ctl.stats()["staleness/dropped"] == step - 2
        if step == 3:  # requeued to the front: the slow worker, alone, leases it again
            again = ctl.lease(slow, LeaseRequest(worker_version=3, max_groups=1)).lease
            assert again.groups[0].prompt_id == late.groups[0].prompt_id
            late = again
    ctl.close()

    cell = staleness_bias.read_cell(str(tmp_path / "ctl.db"), "demo", "pool-b-")
    consumed, dropped = cell["consumed"], cell["dropped"]
    assert (consumed["groups"], dropped["groups"]) == (2, 2)
    assert (consumed["length"], dropped["length"]) == (2.0, 4.0)
    assert (consumed["slow_share"], dropped["slow_share"]) == (0.0, 1.0)
    assert (cell["dropped_prompts"], cell["max_drops_per_prompt"], cell["starved_prompts"]) == (
        1, 2, 1,
    )  # fmt: skip
    head = staleness_bias.headline_of(cell)
    assert head["dropped_frac"] == pytest.approx(0.5)
    assert head["length_bias"] == pytest.approx(2.0)
    assert head["starved_prompts"] == 1
    json.dumps(cell)  # the JSON the bench writes
