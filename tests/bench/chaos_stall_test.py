"""The soak's "no stall longer than B" check (bench/chaos_stall.py) on made-up step times:
a gap is judged against the steady pace plus the allowances of the faults within it."""

from bench import chaos_stall

STEADY = [1000.0 + 2.0 * i for i in range(20)]  # a step every 2 s: base = 30 s


def test_a_gap_within_its_faults_allowance_passes_and_B_sums_the_schedule():
    walls = STEADY + [STEADY[-1] + 150.0 + 2.0 * i for i in range(5)]  # a rerun's restart
    kill = (STEADY[-1] + 1.0, "binary_kill")
    r = chaos_stall.check(walls, [kill], walls[-1] + 2.0, 60.0, startup_s=80.0, corrupt_count=2)
    assert r["ok"], r
    assert r["base_s"] == 30.0 and r["longest_gap_s"] == 150.0  # < 30 + 2 x 80
    assert r["B_s"] == 30.0 + 2 * 80.0


def test_a_stall_past_its_bound_fails_also_at_the_end_of_the_soak():
    corrupt = (STEADY[-1] + 1.0, "corrupt")  # the learner never trains again
    end = STEADY[-1] + 600.0
    r = chaos_stall.check(STEADY, [corrupt], end, 60.0, startup_s=80.0, corrupt_count=2)
    allowed = 30.0 + 2 * (2 * chaos_stall.HEARTBEAT_S + chaos_stall.HEAL_FIRST_WAIT_S + 80.0)
    assert not r["ok"] and r["over_bound"][0]["bound_s"] == allowed
    assert r["longest_gap_s"] == 600.0
    # The same gap with no fault in it is held to the steady pace alone.
    walls = STEADY + [STEADY[-1] + 40.0]
    r = chaos_stall.check(walls, [], walls[-1] + 1.0, 60.0, startup_s=80.0, corrupt_count=2)
    assert not r["ok"] and r["over_bound"][0]["bound_s"] == 30.0


def test_network_faults_allow_their_cut_and_the_lease_ttl():
    """A worker cut off for NET_PARTITION_S holds admission until its leases expire; the
    learner's flapping uplink costs its down and up times and two heartbeats."""
    ttl = 60.0
    allow = chaos_stall.allowances(ttl, startup_s=80.0, corrupt_count=2)
    assert allow["net_partition"] == chaos_stall.NET_PARTITION_S + ttl
    times, down, up = chaos_stall.NET_FLAP
    assert allow["net_flap"] == times * down + (times - 1) * up + 2 * chaos_stall.HEARTBEAT_S
    cut = (STEADY[-1] + 1.0, "net_partition")
    gap = 30.0 + chaos_stall.NET_PARTITION_S + ttl  # base + the partition's allowance
    for extra, ok in ((-1.0, True), (1.0, False)):
        walls = STEADY + [STEADY[-1] + gap + extra]
        r = chaos_stall.check(walls, [cut], walls[-1] + 1.0, ttl, startup_s=80.0, corrupt_count=2)
        assert r["ok"] is ok, r


def test_a_fault_just_before_a_gap_leaves_it_what_remains_of_its_allowance():
    """A graceful restart logs one more step after the SIGINT, and a killed worker's leases
    hold admission past the next step: the gap after the fault's own gets what is left of
    its allowance, and no more."""
    ttl = 60.0
    kill = (STEADY[-1] - 15.0, "worker_kill")  # 15 s before the gap's start: 45 s left
    for extra, ok in ((-1.0, True), (1.0, False)):
        walls = STEADY + [STEADY[-1] + 30.0 + 45.0 + extra]
        r = chaos_stall.check(walls, [kill], walls[-1] + 1.0, ttl, startup_s=80.0, corrupt_count=2)
        assert r["ok"] is ok, r
    # A fault whose allowance ran out before the gap leaves it nothing, and two faults of
    # one kind each leave their own remainder.
    long_ago = (STEADY[0] - 100.0, "worker_kill")
    walls = STEADY + [STEADY[-1] + 40.0]
    r = chaos_stall.check(walls, [long_ago], walls[-1] + 1.0, ttl, startup_s=80.0, corrupt_count=2)
    assert not r["ok"] and r["over_bound"][0]["bound_s"] == 30.0
    both = [kill, (STEADY[-1] - 5.0, "worker_kill")]  # 45 + 55 s left
    walls = STEADY + [STEADY[-1] + 30.0 + 100.0 - 1.0]
    r = chaos_stall.check(walls, both, walls[-1] + 1.0, ttl, startup_s=80.0, corrupt_count=2)
    assert r["ok"], r


def test_the_verdict_is_recomputed_from_the_soaks_json_alone(tmp_path):
    """The answer carries the fault schedule (start times, allowances) and every input;
    `recheck` of its JSON gives the same verdict, and judges the recorded inputs, not the
    recorded verdict: a gap stretched in the JSON fails the recheck."""
    import json

    ttl, kill_at = 60.0, STEADY[-1] - 15.0
    walls = STEADY + [STEADY[-1] + 30.0 + 45.0 - 1.0]  # within what the kill leaves it
    faults = [(kill_at, "worker_kill"), (STEADY[3], "garbage")]
    r = chaos_stall.check(walls, faults, walls[-1] + 1.0, ttl, startup_s=80.0, corrupt_count=2)
    assert r["ok"], r
    assert r["faults"] == [
        {"at": STEADY[3], "after_first_step_s": 6.0, "fault": "garbage", "allowance_s": 0.0},
        {"at": kill_at, "after_first_step_s": round(kill_at - STEADY[0], 1),
         "fault": "worker_kill", "allowance_s": ttl},
    ]  # fmt: skip
    path = tmp_path / "soak.json"
    path.write_text(json.dumps({"soak": {"audit": {"checks": {"no_stall": r}}}}))
    read = json.loads(path.read_text())["soak"]["audit"]["checks"]["no_stall"]
    assert chaos_stall.recheck(read) == r
    assert chaos_stall.main([str(path)]) == 0
    read["inputs"]["walls"][-1] += 2.0  # the last gap now 1 s past its bound
    again = chaos_stall.recheck(read)
    assert not again["ok"] and again["over_bound"][0]["faults"] == ["worker_kill"]
    path.write_text(json.dumps({"soak": {"audit": {"checks": {"no_stall": read}}}}))
    assert chaos_stall.main([str(path)]) == 1
