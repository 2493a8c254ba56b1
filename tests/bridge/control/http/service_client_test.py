"""The controller over real HTTP through the typed client a worker uses: the round trip with
the controller's own rewards, concurrent workers beside the learner, and a restart between
steps that keeps tokens and trajectories."""

import json
import threading
import time

import pytest
from controller_helpers import PROFILE

from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.http.client import ControllerClient, ControllerError
from bridge.control.http.service import (
    ServerOptions,
    load_or_create_join_secret,
    serve_controller,
)
from bridge.control.protocol import (
    GroupResult,
    Heartbeat,
    LeaseRequest,
    SamplingParams,
    Submission,
    WorkerProfile,
    WorkerTrajectory,
)
from bridge.model import tiny_model
from bridge.model.tiny_model import EOS_ID, char_vocab
from bridge.tasks import make_task


def two_token_results(groups, **fields):
    """Typed results for leased `groups`, every sample a two-token completion at version 0;
    `fields` override WorkerTrajectory fields (a callable gets the sample index)."""
    return [
        GroupResult(
            group_id=g.group_id,
            trajectories=[
                WorkerTrajectory(
                    **{
                        "prompt_id": g.prompt_id,
                        "sample_index": i,
                        "prompt_token_ids": g.prompt_token_ids,
                        "completion_token_ids": [6, 2],
                        "logprobs": [-1.0, -0.5],
                        "versions": [0, 0],
                        "finish_reason": "stop",
                        **{k: v(i) if callable(v) else v for k, v in fields.items()},
                    }
                )
                for i in range(g.n)
            ],
        )
        for g in groups
    ]


def test_typed_client_round_trip_with_controller_rewards(service):
    """What a worker does, through the typed client: join, swap when told, lease, generate
    from the leased prompt ids, submit; the learner then takes those trajectories with the
    controller's own rewards (the worker never sees an answer)."""
    ctl, server, _, secret, _ = service
    with pytest.raises(ControllerError) as e:
        ControllerClient.join(server.url, "wrong", WorkerProfile(**PROFILE))
    assert e.value.status == 403
    client, reg = ControllerClient.join(server.url, secret, WorkerProfile(**PROFILE))
    assert reg.announcement.version == -1 and reg.lease_ttl_s == ctl.config.lease_ttl_s
    ctl.publish(0, {"driver": "memory"})
    r = client.lease(LeaseRequest(worker_version=-1, max_groups=2))
    assert r.lease is None and r.reason == "behind" and r.swap_to == 0
    assert client.heartbeat(Heartbeat(worker_version=0, samples_per_s=2.5)).swap_to is None
    lease = client.lease(LeaseRequest(worker_version=0, max_groups=2)).lease
    vocab = char_vocab()
    results, expected = [], {}
    for g in lease.groups:
        assert g.prompt_token_ids == [tiny_model.BOS_ID] + [vocab[ch] for ch in g.prompt]
        # The reference answer lives only in the controller's database.
        [row] = ctl.db.q("SELECT answer FROM groups WHERE group_id=?", (g.group_id,))
        trajs = []
        for i, text in enumerate([row["answer"], "-1"][: g.n]):  # right; wrong (answers >= 0)
            ids = [vocab[ch] for ch in text] + [EOS_ID]
            trajs.append(
                WorkerTrajectory(
                    prompt_id=g.prompt_id,
                    sample_index=i,
                    prompt_token_ids=g.prompt_token_ids,
                    completion_token_ids=ids,
                    logprobs=[-0.25] * len(ids),
                    versions=[0] * len(ids),
                    finish_reason="stop",
                )
            )
        expected[g.group_id] = [1.0, 0.1]  # 0.1: format_reward for a wrong number
        results.append(GroupResult(group_id=g.group_id, trajectories=trajs))
    sub = Submission(lease_id=lease.lease_id, groups=results)
    assert client.submit(sub).accepted == list(expected)
    assert client.submit(sub).duplicates == list(expected)
    assert client.status()["fleet/rollouts_per_s"] == 2.5
    batch, stats = ctl.take_batch(0, 2)
    assert {g.group_id: [t.reward for t in g.trajectories] for g in batch} == expected
    assert batch[0].trajectories[0].completion_token_ids[-1] == EOS_ID
    assert {g.worker_id for g in batch} == {reg.worker_id}
    client.leave()
    client.close()


def test_concurrent_workers_and_learner(tmp_path, text_codec):
    """Three workers over HTTP race a learner that publishes every step: no deadlock, every
    batch fresh, no group consumed twice."""
    S, g, steps = 1, 2, 8
    ctl = Controller(
        ControllerConfig(
            staleness=S,
            groups_per_step=g,
            group_size=2,
            retry_after_s=0.01,
            sampling=SamplingParams(max_tokens=4),
        ),
        str(tmp_path / "c.db"),
        make_task("arithmetic"),
        codec=text_codec,
    )
    server = serve_controller(ctl, str(tmp_path), ServerOptions())
    secret = load_or_create_join_secret(str(tmp_path))
    ctl.publish(0)
    stop, errors = threading.Event(), []

    def work():
        client, reg = ControllerClient.join(server.url, secret, WorkerProfile(**PROFILE))
        version = reg.announcement.version
        try:
            while not stop.is_set():
                r = client.lease(LeaseRequest(worker_version=version, max_groups=2))
                if r.swap_to is not None:
                    version = r.swap_to  # "swap" weights
                if r.lease is None:
                    time.sleep(r.retry_after_s)
                    continue
                groups = two_token_results(r.lease.groups, versions=[version] * 2)
                client.submit(Submission(lease_id=r.lease.lease_id, groups=groups))
        except Exception as e:  # noqa: BLE001 - surfaced by the assert below
            errors.append(e)
        finally:
            client.close()

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    consumed = []
    try:
        for step in range(steps):
            batch, stats = ctl.wait_batch(step, g, timeout_s=30)
            assert batch is not None, stats
            assert stats["staleness/max"] <= S
            consumed += [grp.group_id for grp in batch]
            ctl.publish(step + 1)
    finally:
        stop.set()
        for t in threads:
            t.join()
        server.stop()
        ctl.close()
    assert not errors, errors
    assert len(consumed) == steps * g and len(set(consumed)) == len(consumed)


def test_restart_between_steps_keeps_tokens_and_trajectories(tmp_path, text_codec):
    """Stop the service mid-run and start a new one on the same workdir: the worker's token
    still works, accepted trajectories are all there, consumed ones never come back."""

    def start():
        ctl = Controller(
            ControllerConfig(
                staleness=4, groups_per_step=1, group_size=2, sampling=SamplingParams(max_tokens=4)
            ),
            str(tmp_path / "controller.db"),
            make_task("arithmetic"),
            codec=text_codec,
        )
        return ctl, serve_controller(ctl, str(tmp_path), ServerOptions())

    ctl, server = start()
    ctl.publish(0)
    client, _ = ControllerClient.join(
        server.url, load_or_create_join_secret(str(tmp_path)), WorkerProfile(**PROFILE)
    )
    lease = client.lease(LeaseRequest(worker_version=0, max_groups=3)).lease
    groups = two_token_results(
        lease.groups,
        completion_token_ids=lambda i: [6, i + 7],
        logprobs=[-1.0, -2.0],
        finish_reason="length",
    )
    sub = Submission(lease_id=lease.lease_id, groups=groups)
    client.submit(sub)
    first, _ = ctl.take_batch(0, 1)
    cursor = ctl.export_cursor()  # the learner checkpoints after step 0
    server.stop()
    ctl.close()
    client.close()

    ctl, server = start()
    try:
        ctl.restore_cursor(cursor)
        with open(tmp_path / "controller.json") as f:
            url = json.load(f)["url"]
        assert url == server.url
        client = ControllerClient(url, client.token)
        assert client.submit(sub).duplicates == [g.group_id for g in groups]
        rest = [ctl.take_batch(step, 1)[0] for step in (1, 2)]
        assert ctl.take_batch(3, 1)[0] is None
        got = [b[0] for b in [first, *rest]]
        assert [g.group_id for g in got] == [g.group_id for g in groups]
        unscored = {"reward", "reward_error", "think_tokens"}  # the controller's, not the worker's
        assert [[t.model_dump(exclude=unscored) for t in g.trajectories] for g in got] == [
            [t.model_dump() for t in g.trajectories] for g in groups
        ]
        client.close()
    finally:
        server.stop()
        ctl.close()
