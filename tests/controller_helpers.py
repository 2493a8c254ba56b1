"""Helpers of the controller tests: a controller on a real SQLite file with an injected
clock and the tiny character tokenizer, workers, and submissions built without pydantic's
checks (so the controller's own checks are what a test exercises)."""

import threading

from bridge.contracts.prompt import TextCodec
from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.protocol import (
    GroupResult,
    SamplingParams,
    Submission,
    WorkerProfile,
    WorkerTrajectory,
)
from bridge.model import tiny_model
from bridge.tasks import make_task


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def codec(tmp_path) -> TextCodec:
    """The run's tokenizer (the tiny character-level one)."""
    path = tmp_path / "tokenizer"
    path.mkdir(exist_ok=True)
    tiny_model.save_tokenizer(str(path))
    return TextCodec(str(path))


def make(tmp_path, clock=None, **cfg):
    base = dict(
        staleness=1,
        groups_per_step=2,
        group_size=2,
        lease_ttl_s=10.0,
        sampling=SamplingParams(max_tokens=4),
        vocab_size=100,
    )
    base.update(cfg)
    return Controller(
        ControllerConfig(**base),
        str(tmp_path / "ctl.db"),
        make_task("arithmetic"),
        clock or Clock(),
        codec=codec(tmp_path),
    )


def worker(ctl, price=2.0, max_seqs=64):
    wid, token = ctl.register(
        WorkerProfile(accelerator="cpu", price_per_hour=price, max_concurrent_sequences=max_seqs)
    )
    return wid


def result(group, versions=(0, 0, 0), n=2, **override):
    trajs = []
    for i in range(n):
        fields = dict(
            prompt_id=group.prompt_id,
            sample_index=i,
            prompt_token_ids=list(group.prompt_token_ids),
            completion_token_ids=[10 + i] * len(versions),
            logprobs=[-0.5] * len(versions),
            versions=list(versions),
            finish_reason="stop",
        )
        fields.update(override)
        # model_construct skips pydantic, so the controller's own checks are what is tested.
        trajs.append(WorkerTrajectory.model_construct(**fields))
    return GroupResult.model_construct(group_id=group.group_id, trajectories=trajs)


def submit_all(ctl, wid, lease, versions=(0, 0, 0)):
    return ctl.submit(
        wid, Submission(lease_id=lease.lease_id, groups=[result(g, versions) for g in lease.groups])
    )


def dump(ctl):
    """Everything the controller holds: its tables, after writing its hot state."""
    ctl.flush_hot(expire=False)
    return list(ctl.db.conn.iterdump())


# The worker profile of the HTTP tests (JSON, as a worker sends it).
PROFILE = {
    "accelerator": "cpu",
    "price_per_hour": 0.5,
    "max_concurrent_sequences": 16,
    "region": "local",
}


def register(client, secret):
    r = client.post("/v1/register", json={"join_secret": secret, "profile": PROFILE})
    assert r.status_code == 200, r.text
    return {"Authorization": f"Bearer {r.json()['token']}"}


def submission_json(lease: dict) -> dict:
    """A /v1/submit body answering every group of a lease (as JSON from /v1/lease) with
    the same 3-token completion per sample."""
    groups = []
    for g in lease["groups"]:
        trajs = [
            dict(
                prompt_id=g["prompt_id"],
                sample_index=i,
                prompt_token_ids=g["prompt_token_ids"],
                completion_token_ids=[12, 13, 2],
                logprobs=[-0.1, -2.0, -0.3],
                versions=[0, 0, 0],
                finish_reason="stop",
            )
            for i in range(g["n"])
        ]
        groups.append({"group_id": g["group_id"], "trajectories": trajs})
    return {"lease_id": lease["lease_id"], "groups": groups}


def blocking_fsync(group_commit):
    """Make the next fsyncs wait for `release`; `entered` is set when one starts."""
    entered, release, real = threading.Event(), threading.Event(), group_commit._fsync

    def fsync():
        entered.set()
        assert release.wait(30)
        real()

    group_commit._fsync = fsync
    return entered, release
