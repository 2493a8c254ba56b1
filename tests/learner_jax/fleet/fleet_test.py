"""The fleet follower over real processes: a killed worker is replaced and the run goes on,
a crash-looping worker fails the run naming its log, standby workers are released and a
short fleet grows, all through the provisioner's log; and the config -> provisioners map.

Workers are shell processes from command templates (as tests/bridge/fleet/provisioner_test.py
does); the controller's status table is given as data, since driving a real controller into
standby needs measured vLLM workers (tests/rollout_gpu/lifecycle_test.py, slow)."""

import json
import os
import signal
import time

import pytest

from bridge.fleet.command import CommandProvisioner
from bridge.fleet.provisioner import Limits
from learner_jax.fleet import local_fleet
from learner_jax.fleet.fleet import FleetFollower, FollowConfig

LAUNCH = """#!/bin/sh
# Written whole, then renamed: a reader that sees the file sees the pid.
echo $$ > "$2/$1.pid.part" && mv "$2/$1.pid.part" "$2/$1.pid"
exec sleep 600
"""


def provisioner(tmp_path, start=None, price=1.0, prefix="cmd-", max_workers=4):
    script = tmp_path / "launch.sh"
    script.write_text(LAUNCH)
    token = tmp_path / "join_token"
    token.write_text("s3cret\n")
    return CommandProvisioner(
        str(tmp_path),
        "http://127.0.0.1:1",
        str(token),
        start=start or f"sh {script} {{name}} {{workdir}}",
        stop="kill $(cat {workdir}/{name}.pid)",
        price_per_hour=price,
        limits=Limits(max_workers=max_workers),
        prefix=prefix,
    )


def wait(pred, timeout_s=10):
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def events(tmp_path):
    return [json.loads(line) for line in open(tmp_path / "provisioner.jsonl")]


def row(name, state):
    """A status row of a worker that registered with the credential its provisioner minted
    for its name (bridge/fleet/provisioner.py: the identity the follower matches)."""
    return {"worker_id": name, "name": name, "identity": f"cred:{name}", "state": state,
            "last_contact_s": 1.0}  # fmt: skip


def test_killed_worker_is_replaced(tmp_path):
    prov = provisioner(tmp_path)
    follower = FleetFollower(lambda: {"workers": []}, [prov], FollowConfig(), str(tmp_path))
    try:
        prov.start(2, "local_workers=2")
        wait(lambda: (tmp_path / "cmd-0.pid").exists())
        os.kill(int((tmp_path / "cmd-0.pid").read_text()), signal.SIGKILL)
        wait(lambda: prov._procs["cmd-0"].poll() is not None)
        follower.check(force=True)
        assert sorted(h.name for h in prov.alive()) == ["cmd-1", "cmd-2"]
        follower.check(force=True)  # nothing changed: nothing happens
        assert len(prov.handles) == 3 and follower.replaced == 1
    finally:
        follower.close()
    kinds = [(e["event"], e.get("name"), e.get("reason")) for e in events(tmp_path)]
    assert ("dead", "cmd-0", None) in kinds
    assert ("start", "cmd-2", "fleet: replace dead") in kinds
    assert ("stop", "cmd-2", "learner shutting down") in kinds


def test_crash_loop_fails_the_run_naming_the_log(tmp_path):
    prov = provisioner(tmp_path, start="echo broken install; exit 3")
    follower = FleetFollower(
        lambda: {"workers": []}, [prov], FollowConfig(max_deaths=3), str(tmp_path / "workers")
    )
    prov.start(1, "local_workers=1")
    with pytest.raises(RuntimeError, match=r"keep dying .*workers/cmd-2\.log"):
        for _ in range(10):
            wait(lambda: all(prov._procs[h.name].poll() is not None for h in prov.alive()))
            follower.check(force=True)
    assert "broken install" in (tmp_path / "workers" / "cmd-2.log").read_text()


def test_activation_releases_standby_and_grows_when_short(tmp_path):
    cheap = provisioner(tmp_path, price=0.15, prefix="b-")
    dear = provisioner(tmp_path, price=0.40, prefix="a-")
    status = {"workers": []}
    cfg = FollowConfig(activation=True, max_workers=2, short_cooldown_s=0.0)
    follower = FleetFollower(lambda: status, [dear, cheap], cfg, str(tmp_path))
    try:
        dear.start(1, "local_workers=2")
        cheap.start(1, "local_workers=2")
        a, b = dear.alive()[0].name, cheap.alive()[0].name
        # The controller put the expensive worker on standby: its machine goes back.
        status = {"workers": [row(a, "standby"), row(b, "active")]}
        follower.check(force=True)
        assert dear.alive() == [] and [h.name for h in cheap.alive()] == [b]
        # A freshness-only warning (enough rate) starts nothing.
        status = {
            "workers": [row(a, "gone"), row(b, "active")],
            "capacity/warning": 1,
            "capacity/required_rollouts_per_s": 1.0,
            "capacity/active_rollouts_per_s": 2.0,
        }
        follower.check(force=True)
        assert follower.added == 0
        # Then the active fleet is short: one more worker, the cheapest kind first.
        status = {
            "workers": [row(a, "gone"), row(b, "active")],
            "capacity/warning": 1,
            "capacity/required_rollouts_per_s": 3.0,
            "capacity/active_rollouts_per_s": 1.0,
        }
        follower.check(force=True)
        assert len(cheap.alive()) == 2 and follower.added == 1
        # Not again until the newcomer joined; and never past max_workers.
        follower.check(force=True)
        status["workers"].append(row(cheap.alive()[1].name, "active"))
        follower.check(force=True)
        assert len(cheap.alive()) + len(dear.alive()) == 2
    finally:
        follower.close()
    evs = events(tmp_path)
    stop = next(e for e in evs if e["event"] == "stop" and e["name"] == a)
    assert stop["reason"] == "activation: standby" and stop["price_per_hour"] == 0.40
    start = [e for e in evs if e["event"] == "start" and e["reason"].startswith("activation")]
    assert len(start) == 1 and start[0]["reason"].startswith("activation: short")
    assert start[0]["price_per_hour"] == 0.15


def test_a_worker_refused_as_too_slow_is_released_after_standby_release_s(tmp_path):
    prov = provisioner(tmp_path, price=0.15, prefix="s-")
    clock, status = [0.0], {"workers": []}
    cfg = FollowConfig(standby_release_s=90.0, period_s=5.0)  # activation off: any run
    follower = FleetFollower(lambda: status, [prov], cfg, str(tmp_path), clock=lambda: clock[0])

    def at(t, **states):
        clock[0] = t
        status["workers"] = [row(name, state) for name, state in states.items()]
        follower.check(force=True)
        return sorted(h.name for h in prov.alive())

    try:
        prov.start(2, "local_workers=2")
        a, b = sorted(h.name for h in prov.alive())
        assert at(0, **{a: "active", b: "too_slow"}) == [a, b]
        assert at(55, **{a: "active", b: "too_slow"}) == [a, b]
        # The controller's re-measuring lease shows it briefly not refused: still counting.
        assert at(60, **{a: "active", b: "active"}) == [a, b]
        assert at(65, **{a: "active", b: "too_slow"}) == [a, b]
        assert at(85, **{a: "active", b: "too_slow"}) == [a, b]
        assert at(90, **{a: "active", b: "too_slow"}) == [a]  # 90 s refused: released
        assert follower.slow_released == 1 and follower.slow_idle_s == pytest.approx(90.0)
        # Useful again for three passes (the learner slowed): the count starts over.
        assert at(200, **{a: "too_slow"}) == [a]
        assert at(220, **{a: "active"}) == [a]
        assert at(230, **{a: "too_slow"}) == [a]
        assert at(310, **{a: "too_slow"}) == [a]  # 80 s since the new count began
        assert at(320, **{a: "too_slow"}) == []
    finally:
        follower.close()
    stops = {e["name"]: e for e in events(tmp_path) if e["event"] == "stop"}
    assert stops[b]["reason"] == "too slow: standby" and stops[b]["idle_s"] == pytest.approx(90)
    assert stops[b]["idle_usd"] == pytest.approx(0.15 * 90 / 3600)
    assert stops[a]["reason"] == "too slow: standby" and stops[a]["idle_s"] == pytest.approx(90)
    assert follower.slow_idle_usd == pytest.approx(0.15 * 180 / 3600)


def test_config_to_provisioners(tmp_path):
    (tmp_path / "join_token").write_text("s\n")
    token = str(tmp_path / "join_token")
    cfg = local_fleet.FleetConfig(prices=(0.4, 0.15), throttle_s=(0.0, 0.5))
    provs = local_fleet.make_provisioners(cfg, str(tmp_path), "U", token, seed=1, local_workers=3)
    assert [p.prefix for p in provs] == ["worker-a-", "worker-b-"]
    assert [p.price_per_hour for p in provs] == [0.4, 0.15]
    assert [p.spec.throttle_s for p in provs] == [0.0, 0.5]
    assert local_fleet.initial_counts(cfg, 3) == [2, 1]
    assert provs[0].limits.max_workers == 3  # max_workers=0: local_workers
    one = local_fleet.FleetConfig(prices=(0.2,), throttle_s=(0.0,))
    assert [
        p.prefix for p in local_fleet.make_provisioners(one, str(tmp_path), "U", token, 0, 1)
    ] == ["worker-"]
    cmd = local_fleet.FleetConfig(
        provisioner="command",
        start_command="true",
        stop_command="true",
        price_per_hour=2.0,
        max_usd_per_hour=5.0,
    )
    (p,) = local_fleet.make_provisioners(cmd, str(tmp_path), "U", token, 0, 2)
    assert isinstance(p, CommandProvisioner) and p.price_per_hour == 2.0
    assert p.limits == Limits(max_workers=2, max_usd_per_hour=5.0)
    with pytest.raises(ValueError, match="start_command"):
        local_fleet.make_provisioners(
            local_fleet.FleetConfig(provisioner="command"), str(tmp_path), "U", token, 0, 1
        )


def test_killed_local_worker_is_replaced(tmp_path):
    # Real `python -m rollout_gpu.worker` processes, killed and stopped before they get far.
    (tmp_path / "join_token").write_text("s\n")
    cfg = local_fleet.FleetConfig(prices=(0.2,), throttle_s=(0.0,), grace_s=1.0)
    provs = local_fleet.make_provisioners(
        cfg, str(tmp_path), "http://127.0.0.1:1", str(tmp_path / "join_token"), 0, 1
    )
    follower = FleetFollower(
        lambda: {"workers": []}, provs, FollowConfig(wait_s=10.0), str(tmp_path / "workers")
    )
    try:
        local_fleet.start_initial(provs, cfg, 1)
        (prov,) = provs
        os.kill(prov.handles[0].info["pid"], signal.SIGKILL)
        wait(lambda: prov._procs["worker-0"].poll() is not None)
        follower.check(force=True)
        assert [h.name for h in prov.alive()] == ["worker-1"]
    finally:
        follower.close()
    assert all(p.poll() is not None for p in provs[0]._procs.values())
    assert (tmp_path / "workers" / "worker-1.log").exists()
    reasons = [(e["event"], e.get("reason")) for e in events(tmp_path)]
    assert ("start", "fleet: replace dead") in reasons
