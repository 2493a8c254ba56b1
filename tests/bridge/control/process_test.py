"""The controller in its own process (bridge/control/process.py, issue 25): workers over
HTTP, the learner over loopback, and a SIGKILL of the controller process mid-run: after a
restart on the same database nothing acknowledged is lost (the independent SQLite read
shows every accepted group once, with its payload), tokens still work, the worker carries
on, and the learner's batch holds exactly the acknowledged groups."""

import json
import os
import sqlite3

import httpx
import pytest
from controller_helpers import PROFILE

from bridge.control.config import ControllerConfig
from bridge.control.http.service import ServerOptions, load_or_create_join_secret
from bridge.control.process import DB_FILE, ControllerDied, ControllerProcess
from bridge.control.protocol import SamplingParams
from bridge.tasks import make_task
from tests.controller_helpers import submission_json


def _held(workdir) -> dict[int, int]:
    """group_id -> trajectories, of every accepted group, read from the file alone."""
    conn = sqlite3.connect(f"file:{os.path.join(workdir, DB_FILE)}?mode=ro", uri=True)
    rows = conn.execute(
        "SELECT group_id, payload FROM groups WHERE state IN ('buffered', 'consumed')"
    ).fetchall()
    conn.close()
    return {g: len(json.loads(p)) for g, p in rows}


def test_kill_9_of_the_controller_process_loses_nothing_acknowledged(tmp_path, text_codec):
    workdir = str(tmp_path)
    cfg = ControllerConfig(
        staleness=1, groups_per_step=4, group_size=2, vocab_size=100,
        sampling=SamplingParams(max_tokens=4),
    )  # fmt: skip
    proc = ControllerProcess(cfg, workdir, make_task("arithmetic"), text_codec, ServerOptions())
    proc.start()
    try:
        ctl = proc.controller
        ctl.publish(0, {"driver": "memory"})
        secret = load_or_create_join_secret(workdir)
        http = httpx.Client(timeout=30)
        reg = http.post(
            proc.url + "/v1/register", json={"join_secret": secret, "profile": PROFILE}
        ).json()
        auth = {"Authorization": f"Bearer {reg['token']}"}
        acked = []
        for _ in range(2):
            lease = http.post(
                proc.url + "/v1/lease", headers=auth, json={"worker_version": 0, "max_groups": 1}
            ).json()["lease"]
            r = http.post(proc.url + "/v1/submit", headers=auth, json=submission_json(lease))
            assert r.status_code == 200 and r.json()["accepted"], r.text
            acked += r.json()["accepted"]
        pending = http.post(
            proc.url + "/v1/lease", headers=auth, json={"worker_version": 0, "max_groups": 1}
        ).json()["lease"]  # leased, not yet submitted when the controller dies

        proc.kill()  # SIGKILL: no shutdown, no flush
        assert not proc.alive()
        with pytest.raises(ControllerDied, match=r"died \(exit code -9\).*rerun"):
            ctl.announcement()  # the learner's next call says what happened
        assert _held(workdir) == {g: 2 for g in acked}  # on disk, exactly once

        url = proc.url
        proc.restart()
        assert proc.url == url  # the same port: workers keep their URL
        ctl = proc.controller
        hb = http.post(proc.url + "/v1/heartbeat", headers=auth, json={"worker_version": 0})
        assert hb.status_code == 200  # the same token works after the restart
        r = http.post(proc.url + "/v1/submit", headers=auth, json=submission_json(pending))
        assert r.status_code == 200 and r.json()["accepted"]  # the worker carries on
        acked += r.json()["accepted"]
        lease = http.post(
            proc.url + "/v1/lease", headers=auth, json={"worker_version": 0, "max_groups": 1}
        ).json()["lease"]
        r = http.post(proc.url + "/v1/submit", headers=auth, json=submission_json(lease))
        acked += r.json()["accepted"]
        batch, _ = ctl.wait_batch(0, 4, timeout_s=30)  # the learner, over loopback
        assert sorted(g.group_id for g in batch) == sorted(acked)
        assert len(set(acked)) == 4
        http.close()
    finally:
        proc.stop()
    assert not proc.alive()
