"""Eval leases (issue 26 item 1) through the real HTTP service: the controller offers
evaluation work for version v only to a worker on exactly v (only capacity rollouts leave
idle: `saturate` fills admission first), refuses
results tagged with another version (422, the group goes back to the queue), scores honest
ones with the trusted scorer, writes eval.jsonl lines tagged with v, and hands the learner
eval/accuracy, eval/pass@1, eval/pass@k and eval/mean_length; nothing of it reaches a
training batch."""

import json
import os

import httpx
import numpy as np
import pytest

from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.http.service import ServerOptions, load_or_create_join_secret, serve_controller
from bridge.control.protocol import (
    Heartbeat,
    LeaseRequest,
    SamplingParams,
    Submission,
    WorkerProfile,
)
from bridge.model.tiny_model import EOS_ID, char_vocab
from bridge.tasks import make_task


@pytest.fixture
def service(tmp_path, text_codec):
    """The conftest's served controller, with inline scoring (no reward-pool start inside
    a request: these tests are about leasing, not the pool) and no exact check (their
    completions are written by hand: test_only_checked_groups_count has the check)."""
    yield from _served(tmp_path, text_codec, exact_check=False)


@pytest.fixture
def checked_service(tmp_path, text_codec):
    yield from _served(tmp_path, text_codec, exact_check=True)


def _served(tmp_path, text_codec, **cfg):
    workdir = str(tmp_path)
    ctl = Controller(
        ControllerConfig(
            staleness=1, groups_per_step=2, group_size=2, vocab_size=100,
            sampling=SamplingParams(max_tokens=4), reward_timeout_s=0.0, **cfg,
        ),
        os.path.join(workdir, "controller.db"),
        make_task("arithmetic", format_reward=0.1),
        codec=text_codec,
    )  # fmt: skip
    server = serve_controller(ctl, workdir, ServerOptions())
    secret = load_or_create_join_secret(workdir)
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield ctl, server, client, secret, workdir
    server.stop()
    ctl.close()


PROFILE = {"accelerator": "cpu", "price_per_hour": 0.0, "max_concurrent_sequences": 16}
N = 3


def saturate(ctl):
    """Lease rollout work to filler workers until admission is full at the newest version:
    from then on no worker can get rollout work, and eval leases fill the idle capacity."""
    newest = ctl.announcement().version
    for _ in range(10):
        with ctl.lock:
            if ctl.leasing.room(newest, newest) <= 0:
                return
        filler, _ = ctl.register(WorkerProfile(**PROFILE))
        ctl.lease(filler, LeaseRequest(worker_version=newest, max_groups=16))
    raise AssertionError("admission never filled")


def register(client, secret):
    reg = client.post("/v1/register", json={"join_secret": secret, "profile": PROFILE}).json()
    return {"Authorization": f"Bearer {reg['token']}"}


def trajs(group, texts, version):
    vocab = char_vocab()
    out = []
    for i, text in enumerate(texts):
        ids = [vocab[ch] for ch in text] + [EOS_ID]
        out.append(dict(
            prompt_id=group["prompt_id"], sample_index=i,
            prompt_token_ids=group["prompt_token_ids"], completion_token_ids=ids,
            logprobs=[-0.5] * len(ids), versions=[version] * len(ids), finish_reason="stop",
        ))  # fmt: skip
    return out


def test_eval_leases_at_exactly_one_version(service):
    ctl, _, client, secret, workdir = service
    ctl.configure_eval(workdir)  # the learner's calls (process.py proxies them)
    prompts = make_task("arithmetic", format_reward=0.1).eval_prompts()[:2]
    ctl.publish(0)
    ctl.publish(1)
    assert ctl.request_eval(1, prompts, n=N, temperature=0.6, step=7) == 2
    saturate(ctl)
    old, new = register(client, secret), register(client, secret)

    # A worker on version 0 is not offered version 1's evaluation: rollout work instead.
    r = client.post("/v1/lease", headers=old, json={"worker_version": 0, "max_groups": 1})
    assert r.status_code == 200 and r.json()["lease"] is None, r.json()
    assert r.json()["reason"] != "ok" and r.json()["swap_to"] == 1

    def eval_lease():
        r = client.post("/v1/lease", headers=new, json={"worker_version": 1, "max_groups": 2})
        lease = r.json()["lease"]
        assert lease["lease_id"].startswith("eval-"), lease
        assert all(g["n"] == N and g["sampling"]["temperature"] == 0.6 for g in lease["groups"])
        return lease

    lease = eval_lease()
    by_prompt = {p.text: p.answer for p in prompts}
    groups = lease["groups"]
    # A held-out prompt's id (a digest of a public seed; a deal, for a task that hides
    # state) is not what the worker gets; the results below keep it.
    assert {g["prompt_id"] for g in groups}.isdisjoint(p.prompt_id for p in prompts)

    def submission(version):
        right, wrong = groups[0], groups[1]
        ans = by_prompt[right["prompt"]]
        return {"lease_id": lease["lease_id"], "groups": [
            {"group_id": right["group_id"], "trajectories": trajs(right, [ans, ans, "0"], version)},
            {"group_id": wrong["group_id"], "trajectories": trajs(wrong, ["0", "0", "0"], 1)},
        ]}  # fmt: skip

    # Results at another version are refused, and the groups are offered again.
    r = client.post("/v1/submit", headers=new, json=submission(0))
    assert r.status_code == 422 and "only at the version evaluated" in r.text, r.text
    assert not os.path.exists(ctl.evals.out_path)
    lease = eval_lease()
    groups = lease["groups"]
    r = client.post("/v1/submit", headers=new, json=submission(1))
    assert r.status_code == 200, r.text
    assert sorted(r.json()["accepted"]) == sorted(g["group_id"] for g in groups)

    [summary] = ctl.take_eval_results()
    assert summary["version"] == 1 and summary["prompts"] == 2 and summary["n"] == N
    assert summary["eval/accuracy"] == summary["eval/pass@1"] == 2 / 6
    assert summary["eval/pass@k"] == 0.5  # one prompt of two has a correct sample among 3
    lengths = [len(by_prompt[groups[0]["prompt"]]) + 1] * 2 + [2] * 4
    assert summary["eval/mean_length"] == sum(lengths) / 6
    with open(ctl.evals.out_path) as f:
        [line] = [json.loads(x) for x in f]
    assert line == {**summary, "tag": "fleet", "step": 7, "accuracy": 2 / 6}
    with open(ctl.evals.samples_path) as f:
        lines = [json.loads(x) for x in f]
    assert sorted(x["prompt_id"] for x in lines) == sorted(p.prompt_id for p in prompts)
    assert all(x["version"] == 1 and len(x["rewards"]) == N for x in lines)
    # Never trained on: no eval group is buffered for the learner.
    with ctl.lock:
        assert ctl.db.count("buffered") == 0
    # Nothing left to evaluate (and admission full): the version-1 worker gets no lease.
    r = client.post("/v1/lease", headers=new, json={"worker_version": 1, "max_groups": 1})
    assert r.json()["lease"] is None and r.json()["reason"] == "full", r.json()


def test_a_benchmark_file_is_scored_by_its_own_task(service, tmp_path):
    """task.eval_file: the prompts and the scorer are the file's (math-verify), not the
        run's task: "0.5" is right for the reference \\frac{1}{2} (arithmetic's own check would
    read it as 0)."""
    ctl, _, client, secret, _ = service
    path = tmp_path / "bench.jsonl"
    path.write_text(json.dumps({"problem": "Half of one?", "answer": "\\frac{1}{2}"}) + "\n")
    file_task = make_task("eval_file", path=str(path))
    ctl.publish(0)
    prompts = file_task.eval_prompts()
    assert ctl.request_eval(0, prompts, 2, 1.0, eval_file=str(path))
    saturate(ctl)
    headers = register(client, secret)
    r = client.post("/v1/lease", headers=headers, json={"worker_version": 0, "max_groups": 1})
    lease = r.json()["lease"]
    [group] = lease["groups"]
    sub = {"lease_id": lease["lease_id"], "groups": [
        {"group_id": group["group_id"], "trajectories": trajs(group, ["0.5", "1"], 0)}
    ]}  # fmt: skip
    r = client.post("/v1/submit", headers=headers, json=sub)
    assert r.status_code == 200, r.text
    [summary] = ctl.evals.take_results()
    assert summary["eval/accuracy"] == 0.5 and summary["eval/pass@k"] == 1.0


def test_greedy_evaluation_asks_for_one_sample(service):
    """vLLM refuses n > 1 at temperature 0 (the samples would be identical anyway): a
    worker handed such a lease crashed in the first demo run."""
    ctl, _, client, secret, _ = service
    ctl.publish(0)
    ctl.evals.request(0, make_task("arithmetic").eval_prompts()[:1], n=4, temperature=0.0)
    saturate(ctl)
    r = client.post("/v1/lease", headers=register(client, secret), json={"worker_version": 0})
    [group] = r.json()["lease"]["groups"]
    assert group["n"] == 1 and group["sampling"]["temperature"] == 0.0


@pytest.mark.parametrize("temperature", [0.7, 0.0])
def test_only_checked_groups_count(checked_service, temperature):
    """With the exact check on, a sampled eval lease carries a fresh seed per group (a
    greedy one none), and a scored group counts for its version only once the learner's
    verdict accepts it; a refused group is offered again, and the summary holds only
    groups that passed."""
    ctl, _, client, secret, workdir = checked_service
    ctl.configure_eval(workdir)
    prompts = make_task("arithmetic", format_reward=0.1).eval_prompts()[:2]
    ctl.publish(0)
    ctl.request_eval(0, prompts, n=N, temperature=temperature)
    saturate(ctl)
    headers = register(client, secret)

    def lease_and_submit(texts):
        r = client.post("/v1/lease", headers=headers, json={"worker_version": 0, "max_groups": 2})
        lease = r.json()["lease"]
        seeds = [g["sampling"]["seed"] for g in lease["groups"]]
        sub = {"lease_id": lease["lease_id"], "groups": [
            {"group_id": g["group_id"], "trajectories": trajs(g, texts[: g["n"]], 0)}
            for g in lease["groups"]
        ]}  # fmt: skip
        assert client.post("/v1/submit", headers=headers, json=sub).status_code == 200
        return lease["groups"], seeds

    groups, seeds = lease_and_submit(["1", "2", "3"])
    if temperature > 0:
        assert len(set(seeds)) == 2 and min(seeds) >= 0
    else:
        assert seeds == [-1, -1]
    rows = ctl.take_eval_check_rows()
    assert {r["group_id"] for r in rows} == {g["group_id"] for g in groups}
    assert all(r["seed"] == s for r, s in zip(rows, seeds, strict=True))
    assert ctl.take_eval_results() == []  # nothing counts before the verdict
    assert len(ctl.take_eval_check_rows()) == 2  # until the verdict, asked again
    good, bad = rows[0]["group_id"], rows[1]["group_id"]
    ctl.eval_verified([good], [bad])
    assert ctl.take_eval_check_rows() == [] and ctl.take_eval_results() == []
    [again], new_seeds = lease_and_submit(["4", "5", "6"])
    assert again["group_id"] == bad and (temperature == 0 or new_seeds[0] not in seeds)
    ctl.eval_verified([bad], [])
    [summary] = ctl.take_eval_results()
    assert summary["prompts"] == 2 and summary["version"] == 0


def test_eval_rows_are_sampled_for_the_audit(service):
    """Eval rows carry the worker's log-probs like rollouts: the board keeps a uniform
    sample of each version's trajectories (with the worker and the eval temperature) for
    the learner's audit, handed over once the version is finished, each row once."""
    ctl, _, client, secret, _ = service
    ctl.evals.reservoir.size = 4
    prompts = make_task("arithmetic", format_reward=0.1).eval_prompts()[:3]
    ctl.publish(0)
    assert ctl.request_eval(0, prompts, n=N, temperature=0.7) == 3
    saturate(ctl)
    headers = register(client, secret)
    r = client.post("/v1/lease", headers=headers, json={"worker_version": 0, "max_groups": 3})
    lease = r.json()["lease"]
    sub = {"lease_id": lease["lease_id"], "groups": [
        {"group_id": g["group_id"], "trajectories": trajs(g, ["1", "22", "333"], 0)}
        for g in lease["groups"]
    ]}  # fmt: skip
    assert ctl.take_eval_audit_rows() == []  # nothing before the version is in
    r = client.post("/v1/submit", headers=headers, json=sub)
    assert r.status_code == 200, r.text
    rows = ctl.take_eval_audit_rows()
    assert len(rows) == 4  # 4 of the 9 trajectories
    [(worker_id, version, temperature)] = {(w, v, t) for w, v, t, _ in rows}
    assert worker_id and version == 0 and temperature == 0.7
    assert all(t.logprobs == [-0.5] * len(t.completion_token_ids) for *_, t in rows)
    assert len({(t.prompt_id, t.sample_index) for *_, t in rows}) == 4
    assert ctl.take_eval_audit_rows() == []  # once


def test_a_dropped_version_is_still_audited(service):
    """A version dropped unfinished (the learner moved two versions on) hands over what
    its workers did submit: a worker cannot dodge the audit by making its version stale."""
    ctl, _, client, secret, _ = service
    prompts = make_task("arithmetic", format_reward=0.1).eval_prompts()[:2]
    ctl.publish(0)
    ctl.request_eval(0, prompts, n=2, temperature=1.0)
    saturate(ctl)
    headers = register(client, secret)
    r = client.post("/v1/lease", headers=headers, json={"worker_version": 0, "max_groups": 1})
    lease = r.json()["lease"]
    [g] = lease["groups"]
    sub = {"lease_id": lease["lease_id"], "groups": [
        {"group_id": g["group_id"], "trajectories": trajs(g, ["1", "2"], 0)}
    ]}  # fmt: skip
    assert client.post("/v1/submit", headers=headers, json=sub).status_code == 200
    assert ctl.take_eval_audit_rows() == []  # version 0 is not finished
    for v in (3, 5):  # two newer evaluations pending: version 0 is still kept
        ctl.request_eval(v, prompts, n=2, temperature=1.0)
    assert ctl.take_eval_audit_rows() == []
    ctl.request_eval(7, prompts, n=2, temperature=1.0)  # the third drops it
    rows = ctl.take_eval_audit_rows()
    assert len(rows) == 2 and {v for _, v, _, _ in rows} == {0}


def test_a_worker_is_told_to_keep_its_version_while_its_eval_is_queued(service):
    """Large eval sets finish: while eval groups of version v wait, the lease and submit
    replies to a worker on v say `eval_pending` (the worker then keeps v loaded instead of
    swapping to the newest) and it keeps getting v's eval leases, even after the learner
    published newer versions; the reply that empties v's queue says so."""
    ctl, _, client, secret, _ = service
    prompts = make_task("arithmetic", format_reward=0.1).eval_prompts()[:3]
    ctl.publish(1)
    ctl.request_eval(1, prompts, n=1, temperature=1.0)
    headers = register(client, secret)
    pending = []
    for k in range(3):
        ctl.publish(2 + k)  # the learner moves on
        saturate(ctl)
        r = client.post("/v1/lease", headers=headers, json={"worker_version": 1, "max_groups": 1})
        body = r.json()
        lease = body["lease"]
        assert lease["lease_id"].startswith("eval-") and body["swap_to"] == 2 + k, body
        [g] = lease["groups"]
        sub = {"lease_id": lease["lease_id"], "groups": [
            {"group_id": g["group_id"], "trajectories": trajs(g, ["7"], 1)}
        ]}  # fmt: skip
        s = client.post("/v1/submit", headers=headers, json=sub)
        assert s.status_code == 200, s.text
        pending.append((body["eval_pending"], s.json()["eval_pending"]))
    assert pending == [(True, True), (True, True), (False, False)]
    [summary] = ctl.take_eval_results()
    assert summary["version"] == 1 and summary["prompts"] == 3
    # Nothing queued any more: a rollout lease (or "behind") says nothing pending.
    r = client.post("/v1/lease", headers=headers, json={"worker_version": 4, "max_groups": 1})
    assert r.json()["eval_pending"] is False


def test_the_learner_asks_for_the_version_its_step_publishes(service):
    """learner_jax/rl/fleet_eval.py: on an evaluation step that publishes, the version
    asked for is the one being published (= the learner step), not the announced one the
    workers are about to leave; on a step that publishes nothing, the announced one."""
    import types

    from learner_jax.rl.fleet_eval import FleetEval

    ctl = service[0]
    prompts = make_task("arithmetic").eval_prompts()[:2]
    hook = FleetEval(ctl, prompts, 1, 1.0, period=4, end=100, start=0, publish_every=1)
    hook.after_step(types.SimpleNamespace(step=4, rl_steps=4), {"policy_version": 3})
    hook.after_step(types.SimpleNamespace(step=6, rl_steps=6), {"policy_version": 5})  # not due
    assert set(ctl.evals.pending) == {4}
    hook.close()
    hook = FleetEval(ctl, prompts, 1, 1.0, period=4, end=100, start=0, publish_every=3)
    hook.after_step(types.SimpleNamespace(step=8, rl_steps=8), {"policy_version": 6})
    assert set(ctl.evals.pending) == {4, 6}
    hook.close()


def test_one_worker_per_version_is_held(service):
    """Only the first worker told to hold keeps version v: a second worker on v still gets
    v's eval leases but no `eval_pending` (it swaps and keeps producing rollouts); once v's
    queue is empty nobody holds it."""
    ctl, _, client, secret, _ = service
    prompts = make_task("arithmetic", format_reward=0.1).eval_prompts()[:3]
    ctl.publish(1)
    ctl.request_eval(1, prompts, n=1, temperature=1.0)
    saturate(ctl)
    a, b = register(client, secret), register(client, secret)

    def lease(headers):
        r = client.post("/v1/lease", headers=headers, json={"worker_version": 1, "max_groups": 1})
        body = r.json()
        assert body["lease"]["lease_id"].startswith("eval-"), body
        return body

    assert lease(a)["eval_pending"] is True
    assert lease(b)["eval_pending"] is False  # v still queued, but a holds it
    last = lease(a)
    assert last["eval_pending"] is False  # nothing left queued
    assert ctl.evals.holders == {}


# -- idle capacity only, abandoned versions, dead holders, the run's last evaluation ----------
@pytest.fixture
def clocked(tmp_path, text_codec):
    """The controller object on a hand-moved clock (worker liveness), no HTTP."""
    now = [1000.0]
    ctl = Controller(
        ControllerConfig(
            staleness=1, groups_per_step=2, group_size=2, vocab_size=100, hot_flush_s=0,
            sampling=SamplingParams(max_tokens=4), reward_timeout_s=0.0, exact_check=False,
        ),
        str(tmp_path / "controller.db"),
        make_task("arithmetic", format_reward=0.1),
        clock=lambda: now[0],
        codec=text_codec,
    )  # fmt: skip
    ctl.configure_eval(str(tmp_path))
    yield ctl, now
    ctl.close()


PROMPTS = make_task("arithmetic", format_reward=0.1).eval_prompts()[:4]


def worker(ctl):
    return ctl.register(WorkerProfile(**PROFILE))[0]


def ask(ctl, worker_id, version, k=1):
    return ctl.lease(worker_id, LeaseRequest(worker_version=version, max_groups=k))


def answer(ctl, worker_id, lease, version):
    groups = [
        {"group_id": g.group_id, "trajectories": trajs(g.model_dump(), ["7"] * g.n, version)}
        for g in lease.groups
    ]
    return ctl.submit(worker_id, Submission.model_validate({"lease_id": lease.lease_id,
                                                            "groups": groups}))  # fmt: skip


def is_eval(r):
    return r.lease is not None and r.lease.lease_id.startswith("eval-")


def test_eval_work_only_fills_capacity_rollouts_leave_idle(clocked):
    """Rollout work comes first: while the learner can still use rollouts, a worker on v
    with v's evaluation queued gets rollout work, or (v no longer the newest) "behind" and
    swaps; eval work only once admission is full at the newest version."""
    ctl, _ = clocked
    ctl.publish(0)
    ctl.request_eval(0, PROMPTS[:2], n=1, temperature=1.0)
    w = worker(ctl)
    r = ask(ctl, w, 0)
    assert r.lease is not None and not is_eval(r), r
    ctl.publish(1)
    r = ask(ctl, w, 0)
    assert r.lease is None and r.reason == "behind" and not r.eval_pending, r
    saturate(ctl)
    r = ask(ctl, w, 0)
    assert is_eval(r) and r.eval_pending, r


def test_a_version_no_live_worker_is_on_is_evaluated_at_the_newest(clocked):
    """Workers only move up: once the newest version is past v and no live worker is on v,
    v's evaluation moves to the newest (eval.jsonl: the version evaluated, and the
    versions requested); with the newest's own evaluation queued, the two merge."""
    ctl, _ = clocked
    ctl.publish(1)
    ctl.request_eval(1, PROMPTS[:2], n=1, temperature=1.0, step=11)
    ctl.publish(2)  # every worker is on 2
    saturate(ctl)
    w = worker(ctl)
    r = ask(ctl, w, 2, k=2)
    assert is_eval(r) and len(r.lease.groups) == 2, r
    assert answer(ctl, w, r.lease, 2).accepted
    [summary] = ctl.take_eval_results()
    assert (summary["version"], summary["requested"], summary["step"]) == (2, [1], 11)
    ctl.publish(3)
    ctl.request_eval(3, PROMPTS[:2], n=1, temperature=1.0)
    ctl.request_eval(4, PROMPTS[:2], n=1, temperature=1.0)
    ctl.publish(4)
    saturate(ctl)
    r = ask(ctl, w, 4, k=4)
    assert is_eval(r) and len(r.lease.groups) == 2, r  # one evaluation, not two
    answer(ctl, w, r.lease, 4)
    [summary] = ctl.take_eval_results()
    assert (summary["version"], summary["requested"]) == (4, [3, 4])
    with open(ctl.evals.out_path) as f:
        assert [(x["version"], x["requested"]) for x in map(json.loads, f)] == [
            (2, [1]), (4, [3, 4])
        ]  # fmt: skip
    assert ctl.pending_eval_versions() == []


def test_a_dead_holder_leaves_the_hold_to_a_live_worker(clocked):
    """The worker held on v falls silent (past `worker_timeout_s`): the next live worker on
    v is told `eval_pending` and keeps v until its evaluation is done."""
    ctl, now = clocked
    ctl.publish(1)
    ctl.request_eval(1, PROMPTS, n=1, temperature=1.0)
    saturate(ctl)
    a, b = worker(ctl), worker(ctl)
    ra = ask(ctl, a, 1)
    assert is_eval(ra) and ra.eval_pending and answer(ctl, a, ra.lease, 1).eval_pending
    rb = ask(ctl, b, 1)
    assert is_eval(rb) and not rb.eval_pending  # a holds v
    now[0] += ctl.config.worker_timeout_s + 1  # a is dead; b's lease and the fillers' run on
    ctl.heartbeat(b, Heartbeat(worker_version=1))
    rb = ask(ctl, b, 1)
    assert is_eval(rb) and rb.eval_pending, rb


def test_results_arrive_off_the_learners_thread_and_the_run_waits_for_the_last(clocked, caplog):
    """FleetEval: a background poller brings finished evaluations to the next `after_step`
    (which itself calls the controller only to ask, every `eval_period` steps); `finish`
    (train.py at the end, `eval.final_wait_s`) waits for the evaluation asked at the last
    step; with no worker to do it the wait ends at the limit with a warning naming it."""
    import threading
    import types

    from learner_jax.rl.fleet_eval import FleetEval

    ctl, _ = clocked
    ctl.publish(5)
    hook = FleetEval(ctl, PROMPTS[:2], 1, 1.0, period=1, end=7, start=0, poll_s=0.05)
    step = lambda k: hook.after_step(types.SimpleNamespace(step=k, rl_steps=k), {})  # noqa: E731
    assert step(5) == {} and ctl.pending_eval_versions() == [5]
    saturate(ctl)
    w = worker(ctl)

    def do(version):
        r = ask(ctl, w, version, k=2)
        answer(ctl, w, r.lease, version)

    do(5)
    calls = []
    for name in (
        "request_eval", "take_eval_results", "take_eval_audit_rows", "take_eval_check_rows",
        "eval_verified", "pending_eval_versions",
    ):  # fmt: skip

        def spy(*a, _name=name, **k):
            calls.append(threading.get_ident())
            return getattr(Controller, _name)(ctl, *a, **k)

        setattr(ctl, name, spy)
    got = {}
    for _ in range(200):  # the poller's 0.05 s, with ample slack
        got = hook._drain()
        if got:
            break
        threading.Event().wait(0.05)
    assert got["eval/version"] == 5
    calls.clear()
    assert step(5) == {}  # asked already, nothing new: no controller call on this thread
    for _ in range(200):
        if calls:  # the poller's
            break
        threading.Event().wait(0.05)
    assert calls and threading.get_ident() not in calls
    step(6)  # the last step's evaluation
    ctl.publish(6)
    saturate(ctl)
    timer = threading.Timer(0.3, do, args=(6,))
    timer.start()
    out = hook.finish(timeout_s=60.0, poll_s=0.05)
    timer.join()
    assert out["eval/version"] == 6
    hook = FleetEval(ctl, PROMPTS[:2], 1, 1.0, period=0, end=7, start=0)
    hook.after_step(types.SimpleNamespace(step=7, rl_steps=7), {})
    with caplog.at_level("WARNING"):
        assert hook.finish(timeout_s=0.3, poll_s=0.05) == {}
    assert "gave up waiting for the fleet evaluation of version(s) [7]" in caplog.text


class EvalCheckRun:
    """A controller with a greedy evaluation of two prompts queued, admission full, and
    FleetEval with the run's ExactChecker (learner_jax/rl/fleet_eval.py); `submit` answers
    one eval lease of a worker with tokens chosen by `pick(ids so far)`."""

    def __init__(self, tmp_path, text_codec, tiny_model_dir, margin=None):
        import torch
        import transformers

        from learner_jax import hf_import
        from learner_jax.rl.exact_check import ExactChecker
        from learner_jax.rl.fleet_eval import FleetEval

        self.ctl = ctl = Controller(
            ControllerConfig(
                staleness=1, groups_per_step=2, group_size=2, vocab_size=128, hot_flush_s=0,
                sampling=SamplingParams(max_tokens=4), reward_timeout_s=0.0,
                exact_quarantine_tokens=1,
            ),
            str(tmp_path / "controller.db"),
            make_task("arithmetic", format_reward=0.1),
            codec=text_codec,
        )  # fmt: skip
        ctl.configure_eval(str(tmp_path))
        cfg, params = hf_import.load_hf_params(tiny_model_dir)
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(
            tiny_model_dir, dtype=torch.float32
        )
        margin = {} if margin is None else {"margin": margin}
        checker = ExactChecker(
            lambda v: params, cfg, temperature=1.0, rows_per_call=4, chunk=8, **margin
        )
        self.hook = FleetEval(ctl, PROMPTS[:2], 4, 0.0, period=1, end=9, start=0, exact=checker)
        ctl.publish(0)
        ctl.request_eval(0, PROMPTS[:2], n=4, temperature=0.0)
        saturate(ctl)

    def logits(self, ids):
        import torch

        with torch.no_grad():
            return self.hf(torch.tensor([ids])).logits[0, -1].double().numpy()

    def submit(self, worker_id, pick):
        lease = ask(self.ctl, worker_id, 0).lease
        [g] = lease.groups
        ids = list(g.prompt_token_ids)
        for _ in range(4):
            ids.append(pick(ids))
        completion = ids[len(g.prompt_token_ids) :]
        traj = dict(prompt_id=g.prompt_id, sample_index=0, prompt_token_ids=g.prompt_token_ids,
                    completion_token_ids=completion, logprobs=[-0.5] * 4, versions=[0] * 4,
                    finish_reason="length")  # fmt: skip
        sub = {
            "lease_id": lease.lease_id,
            "groups": [{"group_id": g.group_id, "trajectories": [traj]}],
        }
        assert self.ctl.submit(worker_id, Submission.model_validate(sub)).accepted == [g.group_id]
        return g.group_id


def test_the_learner_checks_every_eval_token(tmp_path, text_codec, tiny_model_dir):
    """FleetEval with the run's ExactChecker: an honest greedy worker's group (the argmax
    of the model, computed here by transformers) is accepted and audited clean; a
    fabricated answer is refused, offered again and its worker quarantined; only the
    accepted group may count."""
    run = EvalCheckRun(tmp_path, text_codec, tiny_model_dir)
    ctl, hook, submit = run.ctl, run.hook, run.submit
    honest, cheat = worker(ctl), worker(ctl)

    def argmax(ids):
        return int(run.logits(ids).argmax())

    good = submit(honest, argmax)
    bad = submit(cheat, lambda ids: 20)  # its own answer
    hook._collect()
    assert cheat in ctl.db.quarantined() and honest not in ctl.db.quarantined()
    assert ctl.evals.groups[good]["state"] == "done"
    assert ctl.evals.groups[bad]["state"] == "queued"
    assert hook._drain()["eval/exact_refused_groups"] == 1.0
    ctl.close()


def test_eval_tokens_are_checked_at_the_margin_of_the_engine_declared(
    tmp_path, text_codec, tiny_model_dir
):
    """The same runner-ups (within the bf16 margin, past the fp32 one, 1e-3) from a worker
    that declared a float32 engine are refused, and from one that declared bfloat16 are
    accepted: the eval rows carry the worker's engine dtype. (The tiny model's top two
    logits lie ~0.2 apart, so the bf16 margin is set to 0.3 + 0.08 max|z| here.)"""
    from bridge.contracts import exact_check

    margin = 0.3
    run = EvalCheckRun(tmp_path, text_codec, tiny_model_dir, margin=margin)
    f32, bf16 = (run.ctl.register(WorkerProfile(**PROFILE, engine_dtype=d))[0]
                 for d in ("float32", "bfloat16"))  # fmt: skip
    near_ties = []

    def runner_up_at_near_ties(ids):
        z = run.logits(ids)
        first, second = np.argsort(z)[::-1][:2]
        gap = z[first] - z[second]
        # clear of both edges: the learner computes z in float32, this in float64
        bf16_margin = margin + exact_check.MARGIN_REL * np.abs(z).max()
        if 2 * exact_check.FLIP_GAP < gap < 0.9 * bf16_margin:
            near_ties.append(gap)
            return int(second)
        return int(first)

    strict = run.submit(f32, runner_up_at_near_ties)
    assert near_ties, "no near tie in these prompts: the test checks nothing"
    loose = run.submit(bf16, runner_up_at_near_ties)
    run.hook._collect()
    assert run.ctl.evals.groups[strict]["state"] == "queued"  # refused, offered again
    assert run.ctl.evals.groups[loose]["state"] == "done"
    assert f32 in run.ctl.db.quarantined() and bf16 not in run.ctl.db.quarantined()
    run.ctl.close()
