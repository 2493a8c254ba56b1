"""Each lease's sampling seeds: fresh per lease, reaching the learner as the trusted side's
own copy, and the same after a controller restart."""

import pytest
from controller_helpers import Clock, make, submit_all, worker

from bridge.contracts.gumbel import SEED_LIMIT
from bridge.control.leasing.sampling_seeds import SamplingSeeds
from bridge.control.protocol import LeaseRequest


def test_every_lease_has_fresh_seeds_and_the_batch_carries_the_lease_seeds(tmp_path):
    clock = Clock()
    ctl = make(tmp_path, clock=clock, staleness=1, groups_per_step=2)
    ctl.publish(0)
    wid = worker(ctl)
    first = ctl.lease(wid, LeaseRequest(worker_version=0, max_groups=2)).lease
    seeds = {g.group_id: g.sampling.seed for g in first.groups}
    assert len(set(seeds.values())) == 2 and all(0 <= s < SEED_LIMIT for s in seeds.values())
    # released and leased again: the same groups, new seeds
    ctl.release(wid, first.lease_id)
    again = ctl.lease(wid, LeaseRequest(worker_version=0, max_groups=2)).lease
    assert {g.group_id for g in again.groups} == set(seeds)
    assert not {g.sampling.seed for g in again.groups} & set(seeds.values())
    submit_all(ctl, wid, again)
    batch, _ = ctl.take_batch(0, 2)
    # the batch's seeds are the controller's, of the lease that delivered each group
    assert {g.group_id: g.sampling_seed for g in batch} == {
        g.group_id: g.sampling.seed for g in again.groups
    }
    secret_seed = ctl.content.seeds.seed(again.lease_id, again.groups[0].group_id)
    ctl.close()
    restarted = make(tmp_path, clock=clock, staleness=1, groups_per_step=2)
    assert restarted.content.seeds.seed(again.lease_id, again.groups[0].group_id) == secret_seed
    restarted.close()


def test_a_seed_depends_on_the_secret_lease_and_group():
    a, b = SamplingSeeds(b"a" * 32), SamplingSeeds(b"b" * 32)
    assert a.seed("lease", 1) == a.seed("lease", 1)
    seeds = {a.seed("lease", 1), a.seed("lease", 2), a.seed("other", 1), b.seed("lease", 1)}
    assert len(seeds) == 4


def test_a_seed_is_the_documented_hmac_and_a_short_secret_is_refused():
    import hashlib
    import hmac

    secret = bytes(range(16))  # the shortest secret allowed
    mac = hmac.new(secret, b"lease-7/3", hashlib.sha256).digest()
    assert SamplingSeeds(secret).seed("lease-7", 3) == int.from_bytes(mac[:8], "big") % SEED_LIMIT
    with pytest.raises(ValueError, match="16 bytes"):
        SamplingSeeds(secret[:15])
