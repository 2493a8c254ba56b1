"""The trust boundary against a hostile worker speaking plain HTTP to the real controller
service: its reward claims are refused and the controller's own scores reach the learner,
altered prompt tokens never reach a batch, a reward function that hangs or raises neither
stalls the server nor crashes anything, and an audited cheater is locked out."""

import os
import threading
import time

import httpx
import pytest

from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.http.service import ServerOptions, load_or_create_join_secret, serve_controller
from bridge.control.protocol import SamplingParams
from bridge.control.trust import audit
from bridge.model.tiny_model import EOS_ID, char_vocab
from bridge.tasks import make_task

PROFILE = {"accelerator": "cpu", "price_per_hour": 0.0, "max_concurrent_sequences": 16}
REWARD_FN = """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if "9" in solution_str:
        time.sleep(60)  # a pathological input: the reward function hangs
    if "8" in solution_str:
        raise ValueError("boom")
    return 1.0 if solution_str.strip() == ground_truth else 0.0
"""


@pytest.fixture
def hostile(tmp_path, text_codec, request):
    """(controller, http client, worker headers, register) on a live service."""
    task_options = getattr(request, "param", {"format_reward": 0.1})
    if task_options == "reward_fn":
        path = tmp_path / "reward.py"
        path.write_text(REWARD_FN)
        task_options = {"reward_fn": f"{path}:compute_score"}
    ctl = Controller(
        ControllerConfig(
            staleness=1,
            groups_per_step=1,
            group_size=2,
            vocab_size=100,
            sampling=SamplingParams(max_tokens=6),
            reward_timeout_s=2.0,
            audit_min_tokens=20,
        ),
        os.path.join(tmp_path, "controller.db"),
        make_task("arithmetic", **task_options),
        codec=text_codec,
    )
    server = serve_controller(ctl, str(tmp_path), ServerOptions())
    secret = load_or_create_join_secret(str(tmp_path))
    with httpx.Client(base_url=server.url, timeout=30) as client:

        def register():
            r = client.post("/v1/register", json={"join_secret": secret, "profile": PROFILE})
            return r.json()["worker_id"], {"Authorization": f"Bearer {r.json()['token']}"}

        yield ctl, client, register
    server.stop()
    ctl.close()


def lease(ctl, client, headers):
    ctl.publish(0)
    r = client.post("/v1/lease", headers=headers, json={"worker_version": 0, "max_groups": 1})
    assert r.status_code == 200, r.text
    return r.json()["lease"]


def submission(lease, texts, **extra):
    group, vocab = lease["groups"][0], char_vocab()
    trajs = []
    for i, text in enumerate(texts):
        ids = [vocab[ch] for ch in text] + [EOS_ID]
        trajs.append(
            dict(
                prompt_id=group["prompt_id"],
                sample_index=i,
                prompt_token_ids=group["prompt_token_ids"],
                completion_token_ids=ids,
                logprobs=[-0.5] * len(ids),
                versions=[0] * len(ids),
                finish_reason="stop",
                **extra,
            )
        )
    groups = [{"group_id": group["group_id"], "trajectories": trajs}]
    return {"lease_id": lease["lease_id"], "groups": groups}


def dump(ctl):
    with ctl.lock:
        return list(ctl.db.conn.iterdump())


def test_lease_carries_no_answer_and_a_claimed_reward_changes_nothing(hostile):
    ctl, client, register = hostile
    _, headers = register()
    got = lease(ctl, client, headers)
    assert "answer" not in got["groups"][0] and "task_options" not in got["groups"][0]
    wrong = ["x", "-1"]  # wrong answers (arithmetic answers are >= 0)
    before = dump(ctl)
    r = client.post("/v1/submit", headers=headers, json=submission(got, wrong, reward=1.0))
    assert r.status_code == 422 and "reward" in r.text
    assert dump(ctl) == before
    r = client.post("/v1/submit", headers=headers, json=submission(got, wrong))
    assert r.status_code == 200, r.text
    [group], _ = ctl.take_batch(0, 1)
    # The controller's own scores: 0 for no number, format_reward 0.1 for a wrong one.
    assert [t.reward for t in group.trajectories] == [0.0, 0.1]


def test_altered_prompt_tokens_never_reach_a_batch(hostile):
    ctl, client, register = hostile
    _, headers = register()
    got = lease(ctl, client, headers)
    leased = got["groups"][0]["prompt_token_ids"]
    for ids in (leased[::-1], leased[:-1], [*leased, 5], leased[1:]):  # swapped, cut, grown
        got["groups"][0]["prompt_token_ids"] = ids
        before = dump(ctl)
        r = client.post("/v1/submit", headers=headers, json=submission(got, ["1", "2"]))
        assert r.status_code == 422, r.text
        gid = got["groups"][0]["group_id"]
        assert f"group {gid}" in r.json()["detail"] and "leased prompt" in r.json()["detail"]
        assert dump(ctl) == before
    assert ctl.take_batch(0, 1)[0] is None
    assert ctl.stats()["groups/accepted"] == 0


@pytest.mark.parametrize("hostile", ["reward_fn"], indirect=True)
def test_a_hanging_or_raising_reward_neither_stalls_nor_crashes(hostile):
    ctl, client, register = hostile
    _, headers = register()
    _, other = register()
    got = lease(ctl, client, headers)
    done = {}

    def submit():
        t0 = time.monotonic()
        done["r"] = client.post("/v1/submit", headers=headers, json=submission(got, ["9", "8"]))
        done["s"] = time.monotonic() - t0

    thread = threading.Thread(target=submit)
    thread.start()
    time.sleep(0.5)  # the submission is now being scored (the reward hangs)
    t0 = time.monotonic()
    hb = client.post("/v1/heartbeat", headers=other, json={"worker_version": 0})
    assert hb.status_code == 200 and time.monotonic() - t0 < 1.0  # the lock is not held
    thread.join()
    assert done["r"].status_code == 200, done["r"].text
    [group], stats = ctl.take_batch(0, 1)
    assert [t.reward for t in group.trajectories] == [0.0, 0.0]
    assert group.trajectories[0].reward_error.startswith("RewardTimeout")
    assert "boom" in group.trajectories[1].reward_error
    assert stats["reward/errors"] == 2 and stats["reward/timeouts"] == 1


def test_an_audited_cheater_is_quarantined(hostile):
    ctl, client, register = hostile
    cheat, headers = register()
    honest, honest_headers = register()
    got = lease(ctl, client, headers)
    assert client.post("/v1/submit", headers=headers, json=submission(got, ["1", "2"])).is_success
    assert ctl.stats()["groups/buffered"] == 1
    fine = audit.AuditStat(honest, 0, tokens=400, sum_k3=400 * 1e-4, sum_logratio=0.01)
    bad = audit.AuditStat(cheat, 0, tokens=10, sum_k3=10 * 3.0, sum_logratio=10 * 4.0)
    assert ctl.audit([fine, bad]) == []  # not enough evidence yet (audit_min_tokens=20)
    assert ctl.audit([fine, bad]) == [cheat]
    assert ctl.audit([bad]) == []  # counted once
    stats = ctl.stats()
    assert stats["fleet/quarantined"] == 1 and stats["audit/dropped_groups"] == 1
    assert stats["groups/buffered"] == 0 and stats["groups/queued"] >= 1  # its work requeued
    r = client.post("/v1/heartbeat", headers=headers, json={"worker_version": 0})
    assert r.status_code == 401
    assert client.post("/v1/lease", headers=honest_headers, json={"worker_version": 0}).is_success
