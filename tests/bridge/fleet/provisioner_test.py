"""Provisioners without a controller: the command templates (a shell script standing in for
a cloud CLI), limits checked before anything starts, the JSONL log, and the reconciler
replacing a killed worker and stopping the ones an activation decision puts on standby.
(tests/rollout_gpu/lifecycle_test.py does the same with real rollout workers.)"""

import json
import os
import signal
import time

from bridge.control.trust.identity import identity_of
from bridge.fleet.command import CommandProvisioner, fill
from bridge.fleet.local import LocalWorkerSpec, worker_command
from bridge.fleet.provisioner import Limits
from bridge.fleet.reconcile import reconcile

# "Launches a machine": a foreground process that records its name and pid; "deletes" it
# by the pid it recorded under its name, as a cloud CLI deletes an instance by name.
LAUNCH = """#!/bin/sh
# Written whole, then renamed: a reader that sees the file sees the pid.
echo $$ > "$4/$3.pid.part" && mv "$4/$3.pid.part" "$4/$3.pid"
echo "$1 $2 $3" > "$4/$3.started"
exec sleep 600
"""


def provisioner(tmp_path, **kw):
    script = tmp_path / "launch.sh"
    script.write_text(LAUNCH)
    token = tmp_path / "join_token"
    token.write_text("s3cret\n")
    return CommandProvisioner(
        str(tmp_path),
        "http://127.0.0.1:1",
        str(token),
        start=f"sh {script} {{url}} {{secret}} {{name}} {{workdir}}",
        stop="kill $(cat {workdir}/{name}.pid) && echo stopped {name} > {workdir}/{name}.stopped",
        price_per_hour=1.5,
        **kw,
    )


def wait(pred, timeout_s=10):
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_templates_limits_log_and_reconcile(tmp_path):
    prov = provisioner(tmp_path, limits=Limits(max_workers=3, max_usd_per_hour=4.0))
    try:
        started = prov.start(3, "test")  # $4/h allows two at $1.5/h
        assert [h.name for h in started] == ["cmd-0", "cmd-1"]

        # Both machines' scripts have run (they start in any order, and `echo >` creates a
        # file before it writes the line: wait for the whole line).
        def recorded(name):
            f = tmp_path / f"{name}.started"
            return f.exists() and len(f.read_text().split()) == 3

        wait(lambda: recorded("cmd-0") and recorded("cmd-1"))
        # The machine got its own credential, not the join secret; the controller's check
        # makes it `cred:cmd-0` from any address, the identity the follower looks for.
        url, credential, name = (tmp_path / "cmd-0.started").read_text().split()
        assert (url, name) == ("http://127.0.0.1:1", "cmd-0") and "s3cret" not in credential
        assert identity_of(credential, ["s3cret"], "203.0.113.7") == "cred:cmd-0"
        assert os.stat(tmp_path / "credentials" / "cmd-0").st_mode & 0o077 == 0

        # A killed worker is replaced; the newcomer gets a fresh name.
        os.kill(int((tmp_path / "cmd-0.pid").read_text()), signal.SIGKILL)
        wait(lambda: prov._procs["cmd-0"].poll() is not None)
        r = reconcile(prov, 2, reason="test")
        assert [h.name for h in r.dead] == ["cmd-0"] and [h.name for h in r.started] == ["cmd-2"]

        # An activation decision keeps cmd-2 only: cmd-1's stop command runs.
        r = reconcile(prov, {"cmd-2"}, reason="activation")
        assert [h.name for h in r.stopped] == ["cmd-1"]
        assert (tmp_path / "cmd-1.stopped").read_text().strip() == "stopped cmd-1"
        wait(lambda: prov._procs["cmd-1"].poll() is not None)
        assert [h.name for h in prov.alive()] == ["cmd-2"]

        # The controller reporting a worker gone counts as dead, too.
        wait(lambda: (tmp_path / "cmd-2.pid").exists())
        # A worker that took cmd-2's name under another identity is not cmd-2: its
        # quarantine stops nothing of ours.
        squatter = {"name": "cmd-2", "identity": "host:203.0.113.9", "last_contact_s": 1.0}
        r = reconcile(prov, {"cmd-2"}, [{**squatter, "state": "quarantined"}], reason="t")
        assert r.dead == [] and r.stopped == [] and [h.name for h in prov.alive()] == ["cmd-2"]
        ours = {"name": "cmd-2", "identity": "cred:cmd-2", "last_contact_s": 40.0}
        rows = [{**ours, "state": "gone"}, {**squatter, "state": "active"}]
        r = reconcile(prov, {"cmd-2"}, rows, reason="activation")
        assert [h.name for h in r.dead] == ["cmd-2"] and [h.name for h in r.started] == ["cmd-3"]
        wait(lambda: (tmp_path / "cmd-3.pid").exists())
    finally:
        prov.stop_all("test over")
    events = [json.loads(line) for line in open(tmp_path / "provisioner.jsonl")]
    kinds = [(e["event"], e.get("name")) for e in events]
    assert kinds[:3] == [("refused", None), ("start", "cmd-0"), ("start", "cmd-1")]
    assert ("dead", "cmd-0") in kinds and ("stop", "cmd-1") in kinds
    stop = next(e for e in events if e["event"] == "stop" and e["name"] == "cmd-1")
    assert stop["reason"] == "activation: standby" and stop["cost_usd"] > 0
    assert all(e["price_per_hour"] == 1.5 for e in events)
    # A new provisioner on the same workdir does not reuse names.
    assert provisioner(tmp_path)._next == 4


def test_fill_quotes_and_leaves_other_braces():
    cmd = fill("echo {name} ${HOME} {x}", {"name": "a b; rm -rf /"})
    assert cmd == "echo 'a b; rm -rf /' ${HOME} {x}"


def test_local_command_line_matches_the_local_fleet():
    cmd = worker_command(LocalWorkerSpec(price_per_hour=2.0, seed=3), "U", "T", "/w", "w-1", 1)
    assert cmd[1:3] == ["-m", "rollout_gpu.worker"]
    assert "--controller=U" in cmd and "--token_file=T" in cmd and "--name=w-1" in cmd
    assert "--seed=3001" in cmd and "--cache_dir=/w/model_files" in cmd
    assert "--exit_with_parent" in cmd  # tests/rollout_gpu/parent_exit_test.py


def test_local_workers_are_pinned_to_fleet_worker_cpus():
    import subprocess
    import sys

    import pytest

    from bridge.fleet import local
    from learner_jax.fleet.local_fleet import FleetConfig, local_specs

    cpu = max(os.sched_getaffinity(0))  # one this test may use; the child must get only it
    (spec,) = local_specs(FleetConfig(worker_cpus=(cpu,)), seed=0)
    code = "import os; print(sorted(os.sched_getaffinity(0)))"
    child = subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=local._pin(spec.cpus),
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(child.stdout) == [cpu]
    assert local._pin(()) is None  # not pinned: any CPU
    with pytest.raises(ValueError, match="this machine has CPUs"):
        local._pin((os.cpu_count(),))
