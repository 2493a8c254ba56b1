"""Scoring sees what the model said (issue 23 item 7): a hostile worker hides a token the
reward would not see inside the right answer (a special token, an id past the tokenizer's
99 tokens in the model's 128-id vocabulary, a stop token mid-answer). Decoded with special
tokens skipped, "4<pad>2" read as "42" and scored 1.0; through the real HTTP service each
such completion now scores 0, says why, and counts against the worker."""

import os

import httpx
import pytest

from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.http.service import ServerOptions, load_or_create_join_secret, serve_controller
from bridge.control.protocol import SamplingParams
from bridge.model.tiny_model import BOS_ID, EOS_ID, PAD_ID, char_vocab
from bridge.tasks import make_task

PROFILE = {"accelerator": "cpu", "price_per_hour": 0.0, "max_concurrent_sequences": 16}
PADDED_ID = 120  # inside the model's vocabulary (128), outside the tokenizer's (99)


@pytest.fixture
def served(tmp_path, text_codec):
    ctl = Controller(
        ControllerConfig(
            staleness=1,
            groups_per_step=1,
            group_size=5,
            vocab_size=128,  # the tiny model's padded vocabulary, as the training binary sets it
            sampling=SamplingParams(max_tokens=8),
            reward_timeout_s=0.0,  # inline scoring: the decode under test runs before the pool
        ),
        os.path.join(tmp_path, "controller.db"),
        make_task("arithmetic", format_reward=0.1),
        codec=text_codec,
    )
    server = serve_controller(ctl, str(tmp_path), ServerOptions())
    secret = load_or_create_join_secret(str(tmp_path))
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield ctl, client, secret
    server.stop()
    ctl.close()


def test_a_hidden_token_inside_the_answer_scores_zero_and_counts_against_the_worker(served):
    ctl, client, secret = served
    reg = client.post("/v1/register", json={"join_secret": secret, "profile": PROFILE}).json()
    worker, headers = reg["worker_id"], {"Authorization": f"Bearer {reg['token']}"}
    ctl.publish(0)
    r = client.post("/v1/lease", headers=headers, json={"worker_version": 0, "max_groups": 1})
    lease_id, group = r.json()["lease"]["lease_id"], r.json()["lease"]["groups"][0]
    with ctl.lock:  # the reference answer never left the controller
        answer = ctl.db.groups_of_lease(lease_id)[0]["answer"]
    vocab = char_vocab()
    ids = [vocab[ch] for ch in answer]
    cut = min(1, len(ids) - 1)  # inside a 2-digit answer, before a 1-digit one

    def hide(token):  # the right answer with `token` hidden in it, then the stop token
        return [*ids[:cut], token, *ids[cut:], EOS_ID]

    completions = [
        [*ids, EOS_ID],  # honest: scores 1.0
        hide(PAD_ID),  # a special token joins the digits
        hide(BOS_ID),
        hide(PADDED_ID),  # an id the tokenizer does not have
        hide(EOS_ID),  # a stop token mid-completion
    ]
    trajs = [
        dict(
            prompt_id=group["prompt_id"],
            sample_index=i,
            prompt_token_ids=group["prompt_token_ids"],
            completion_token_ids=c,
            logprobs=[-0.5] * len(c),
            versions=[0] * len(c),
            finish_reason="stop",
        )
        for i, c in enumerate(completions)
    ]
    sub = {"lease_id": lease_id, "groups": [
        {"group_id": group["group_id"], "trajectories": trajs}
    ]}  # fmt: skip
    r = client.post("/v1/submit", headers=headers, json=sub)
    assert r.status_code == 200, r.text
    [batch], stats = ctl.take_batch(0, 1)
    got = sorted(batch.trajectories, key=lambda t: t.sample_index)
    assert [t.reward for t in got] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert got[0].reward_error == ""
    assert all(t.reward_error.startswith("HiddenToken") for t in got[1:]), got
    assert "outside the tokenizer's vocabulary" in got[3].reward_error
    with ctl.lock:
        assert ctl.workers.hidden_tokens(worker) == 4
        assert ctl.db.get("reward/hidden_tokens") == 4
    assert stats["reward/errors"] == 0  # no reward function failed: a rule scored them 0
    # A resubmission is a duplicate: the evidence is not counted twice.
    assert client.post("/v1/submit", headers=headers, json=sub).json()["duplicates"]
    with ctl.lock:
        assert ctl.workers.hidden_tokens(worker) == 4
