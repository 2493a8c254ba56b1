"""The fleet table over real HTTP: GET /v1/status with the join secret (read-only) and
`python -m bridge.status --workdir`; run end as workers see it (run_over in heartbeats and
leases, `workers_told_run_over`)."""

import os
import subprocess
import sys

import httpx
import pytest

from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.http.client import ControllerClient
from bridge.control.http.service import ServerOptions, load_or_create_join_secret, serve_controller
from bridge.control.protocol import Heartbeat, LeaseRequest, SamplingParams, WorkerProfile
from bridge.status import format_status
from bridge.tasks import make_task

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


@pytest.fixture
def served(tmp_path, text_codec):
    ctl = Controller(
        ControllerConfig(groups_per_step=2, group_size=2, sampling=SamplingParams(max_tokens=4)),
        str(tmp_path / "controller.db"),
        make_task("arithmetic"),
        codec=text_codec,
    )
    server = serve_controller(ctl, str(tmp_path), ServerOptions())
    secret = load_or_create_join_secret(str(tmp_path))
    yield ctl, server, secret, str(tmp_path)
    server.stop()
    ctl.close()


def join(server, secret, name, price=0.5):
    profile = WorkerProfile(
        accelerator="cpu", price_per_hour=price, max_concurrent_sequences=8, name=name
    )
    return ControllerClient.join(server.url, secret, profile)


def test_status_endpoint_and_cli_print_the_fleet_table(served):
    ctl, server, secret, workdir = served
    a, reg_a = join(server, secret, "cmd-0", price=2.0)
    b, reg_b = join(server, secret, "cmd-1")
    a.heartbeat(Heartbeat(worker_version=-1, samples_per_s=3.5))
    ctl.set_worker_enabled(reg_b.worker_id, False)
    b.heartbeat(Heartbeat(worker_version=-1))

    # Operator access with the join secret; a wrong bearer is refused; workers may read it.
    url = server.url + "/v1/status"
    assert httpx.get(url, headers={"Authorization": "Bearer nope"}).status_code == 401
    status = httpx.get(url, headers={"Authorization": f"Bearer {secret}"}).json()
    assert a.status()["run"] == status["run"]
    assert httpx.post(url, headers={"Authorization": f"Bearer {secret}"}).status_code == 401
    rows = {w["name"]: w for w in status["workers"]}
    assert rows["cmd-0"]["state"] == "active" and rows["cmd-0"]["rollouts_per_s"] == 3.5
    assert rows["cmd-1"]["state"] == "standby" and rows["cmd-0"]["price_per_hour"] == 2.0
    assert status["run"]["workers"]["active"] == 1 and status["run"]["staleness_bound"] == 2
    assert status["groups/accepted"] == 0  # the flat stats are still there

    b.leave()
    out = subprocess.run(
        [sys.executable, "-m", "bridge.status", f"--workdir={workdir}", "--all"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split()[:4] == ["worker", "name", "state", "version"]
    assert any(reg_a.worker_id in line and "active" in line and "3.50" in line for line in lines)
    assert any(reg_b.worker_id in line and "gone" in line for line in lines)
    assert any(line.startswith("step 0") and "spend $" in line for line in lines)
    assert "gone" not in format_status(status | {"workers": status["workers"][:1]})


def test_run_over_is_told_in_heartbeats_and_leases(served):
    ctl, server, secret, _ = served
    a, reg_a = join(server, secret, "a")
    b, _ = join(server, secret, "b")
    assert not a.heartbeat(Heartbeat(worker_version=-1)).run_over
    ctl.end_run()
    assert not ctl.workers_told_run_over()
    assert a.heartbeat(Heartbeat(worker_version=-1)).run_over
    assert not ctl.wait_run_over_seen(timeout_s=0.2)  # b has not polled yet
    assert b.lease(LeaseRequest(worker_version=-1)).reason == "run_over"
    assert ctl.wait_run_over_seen(timeout_s=1)
    assert ctl.status()["run"]["run_over"]
