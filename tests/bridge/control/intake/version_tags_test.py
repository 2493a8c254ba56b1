"""Version tags are tied to the lease (issue 23 item 5), over real HTTP on loopback: a
worker that took its lease at version 1 cannot tag tokens with version 0 (a version the
lease did not give; such rows went to the sampled re-score instead of the train step's
audit), in whole or in part; nothing is buffered and the learner's batch stays empty. A
swap mid-generation (tags 1 then 2) is accepted: those rows are audited token by token by
learner_jax/rl/rescore.py (tests/learner_jax/rl/rescore_test.py)."""

from bridge.model.tiny_model import EOS_ID, char_vocab


def submission(lease, versions):
    group, ids = lease["groups"][0], [char_vocab()["1"], EOS_ID]
    trajs = [
        dict(prompt_id=group["prompt_id"], sample_index=i,
             prompt_token_ids=group["prompt_token_ids"], completion_token_ids=ids,
             logprobs=[-0.5, -0.5], versions=list(versions), finish_reason="stop")
        for i in range(2)
    ]  # fmt: skip
    return {"lease_id": lease["lease_id"],
            "groups": [{"group_id": group["group_id"], "trajectories": trajs}]}  # fmt: skip


def dump(ctl):
    with ctl.lock:
        return list(ctl.db.conn.iterdump())


def test_tags_older_than_the_lease_are_refused(service):
    ctl, server, client, secret, _ = service
    r = client.post(
        "/v1/register",
        json={
            "join_secret": secret,
            "profile": {
                "accelerator": "cpu",
                "price_per_hour": 0.0,
                "max_concurrent_sequences": 16,
            },
        },
    )
    headers = {"Authorization": f"Bearer {r.json()['token']}"}  # fmt: skip
    ctl.publish(0)
    ctl.publish(1)
    got = client.post("/v1/lease", headers=headers, json={"worker_version": 1, "max_groups": 1})
    lease = got.json()["lease"]
    before = dump(ctl)
    for versions in ([0, 0], [0, 1]):  # wholly, and partly, a version the lease did not give
        r = client.post("/v1/submit", headers=headers, json=submission(lease, versions))
        assert r.status_code == 422 and "lease was taken at version 1" in r.text, r.text
        assert dump(ctl) == before
    assert ctl.take_batch(0, 1)[0] is None and ctl.stats()["groups/buffered"] == 0
    ctl.publish(2)  # a swap mid-generation: accepted
    r = client.post("/v1/submit", headers=headers, json=submission(lease, [1, 2]))
    assert r.status_code == 200 and r.json()["accepted"] == [lease["groups"][0]["group_id"]]
