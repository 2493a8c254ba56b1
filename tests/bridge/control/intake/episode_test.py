"""Multi-turn episodes through the real controller service (HTTP on loopback): the lease
carries the episode, the controller replays the environment from (seed, decoded actions)
in the reward pool, the replayed reward is what reaches the learner (the worker sends
none), and every malformed or made-up episode is refused with a 4xx before anything is
buffered. The "worker" here plays Kuhn poker with scripted actions on its own copy of the
environment, exactly as rollout_gpu/episodes.py does with sampled ones."""

import itertools
import os
import re
from typing import NamedTuple

import httpx
import pytest

from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.http.service import ServerOptions, load_or_create_join_secret, serve_controller
from bridge.control.leasing.prompt_stream import stream_seed
from bridge.control.protocol import LeaseRequest, SamplingParams, WorkerProfile
from bridge.control.state.db import ControllerDB
from bridge.model.tiny_model import EOS_ID
from bridge.tasks import EnvTask, make_env, make_task

PROFILE = {"accelerator": "cpu", "price_per_hour": 0.0, "max_concurrent_sequences": 16}
GROUP = 4


def _two_turn_secret(task) -> bytes:
    """A run secret whose first training prompt is a hand where the model checks first and
    the opponent bets: a check then leaves an observation and a second model turn. (The
    controller draws an environment's prompts from a stream keyed by its secret,
    prompt_stream.py; the test writes one into the database before the controller starts.)"""
    for i in range(100):
        secret = bytes([i]) * 32
        env = task.new_env()
        env.reset(EnvTask.seed_of(next(task.train_prompts(stream_seed(secret, 0)))))
        if env.seat == 0 and env.opp in "JK":  # this opponent bets J and K after a check
            return secret
    raise AssertionError("no such secret")


def _controller(tmp_path, text_codec, task, **cfg):
    path = os.path.join(tmp_path, "controller.db")
    db = ControllerDB(path)
    with db.tx():
        db.put("prompt_secret", _two_turn_secret(task).hex())
    db.close()
    config = dict(
        staleness=1,
        groups_per_step=1,
        group_size=GROUP,
        vocab_size=100,
        sampling=SamplingParams(max_tokens=16, stop_token_ids=[EOS_ID]),
        max_completion_tokens=40,
        reward_timeout_s=5.0,  # replays run in the reward pool, as in a real run
    )
    return Controller(ControllerConfig(**{**config, **cfg}), path, task, codec=text_codec)


@pytest.fixture
def served(tmp_path, text_codec, request):
    task = make_task("kuhn_poker", turn_max_tokens=3)
    ctl = _controller(tmp_path, text_codec, task, **getattr(request, "param", {}))
    server = serve_controller(ctl, str(tmp_path), ServerOptions())
    secret = load_or_create_join_secret(str(tmp_path))
    with httpx.Client(base_url=server.url, timeout=60) as client:
        r = client.post("/v1/register", json={"join_secret": secret, "profile": PROFILE})
        headers = {"Authorization": f"Bearer {r.json()['token']}"}
        ctl.publish(0)
        r = client.post("/v1/lease", headers=headers, json={"worker_version": 0, "max_groups": 1})
        assert r.status_code == 200, r.text
        lease = r.json()["lease"]
        # The lease hides the seed (a deal); this test's scripted "worker" checks the
        # controller's observations against its own copy of the environment, so it takes
        # the seed from the controller's database (the trusted side).
        spec = lease["groups"][0]["episode"]
        assert spec["seed"] == -1
        spec["seed"] = int(ctl.db.groups_in("leased")[0]["answer"])
        yield Served(ctl, client, headers, lease, text_codec)
    server.stop()
    ctl.close()


class Served(NamedTuple):
    ctl: Controller
    client: httpx.Client
    headers: dict
    lease: dict
    codec: object


def ask(served, turns, i=0, lease_id=None, gid=None, headers=None):
    """POST /v1/episode for one episode of the served lease (or the ones named)."""
    group = served.lease["groups"][0]
    body = {"lease_id": lease_id or served.lease["lease_id"],
            "episodes": [{"group_id": group["group_id"] if gid is None else gid,
                          "sample_index": i, "turns": turns}]}  # fmt: skip
    return served.client.post("/v1/episode", headers=headers or served.headers, json=body)


def play(served, actions, index=0, commit=True):
    """One honest episode, sample `index` of the lease's group, played as a worker does:
    each model turn sent to POST /v1/episode, each observation the controller's (checked
    against the test's own copy of the environment). (trajectory dict, its reward, done).
    `commit=False`: played on the test's environment alone, the controller never asked."""
    group, codec = served.lease["groups"][0], served.codec
    spec = group["episode"]
    env = make_env(spec["env"], **spec["options"])
    assert codec.encode_prompt(env.reset(spec["seed"])) == group["prompt_token_ids"]
    ids, mask, logprobs, turns, total = [], [], [], [], 0.0
    for i, action in enumerate(actions):
        turn = codec.encode(action) + [EOS_ID]
        turns.append(turn)
        ids, mask, logprobs = ids + turn, mask + [1] * len(turn), logprobs + [-0.7] * len(turn)
        obs, reward, done = env.step(action)
        total += reward
        if commit:
            r = ask(served, turns, index)
            assert r.status_code == 200, r.text
            assert r.json()["observations"] == [{"observation": "" if done else obs, "done": done}]
        if done or i == len(actions) - 1:
            break
        shown = codec.encode(obs)
        ids, mask, logprobs = ids + shown, mask + [0] * len(shown), logprobs + [0.0] * len(shown)
    traj = dict(
        prompt_id=group["prompt_id"],
        sample_index=index,
        prompt_token_ids=group["prompt_token_ids"],
        completion_token_ids=ids,
        logprobs=logprobs,
        versions=[0] * len(ids),
        finish_reason="stop",
        completion_mask=mask,
    )
    return traj, total, done


def submit(client, headers, lease, trajs):
    trajs = [dict(t, sample_index=i) for i, t in enumerate(trajs)]
    group = {"group_id": lease["groups"][0]["group_id"], "trajectories": trajs}
    return client.post(
        "/v1/submit", headers=headers, json={"lease_id": lease["lease_id"], "groups": [group]}
    )


SCRIPTS = (["c", "c"], ["b", "c"], ["f"], ["x", "c"])


def test_lease_carries_the_episode_and_the_replayed_reward_reaches_the_batch(served):
    ctl, client, headers, lease, codec = served
    group = lease["groups"][0]
    spec = group["episode"]
    assert spec["env"] == "kuhn_poker" and spec["max_turns"] == 2 and spec["max_tokens"] == 40
    assert group["sampling"]["max_tokens"] == 3  # the task's turn_max_tokens caps each turn
    assert group["prompt_id"] == ctl.task.prompt_id(spec["seed"])
    played = [play(served, s, i) for i, s in enumerate(SCRIPTS)]
    r = submit(client, headers, lease, [t for t, _, _ in played])
    assert r.status_code == 200, r.text
    batch, _ = ctl.take_batch(0, 1)
    trajs = sorted(batch[0].trajectories, key=lambda t: t.sample_index)
    for t, (sent, worker_reward, done) in zip(trajs, played, strict=True):
        assert t.reward == worker_reward + (0.0 if done else -1.0)  # unfinished: a fold
        assert t.completion_mask == sent["completion_mask"]
        assert t.reward_error == ""
    # The fold is -1 whatever the deal; an invalid action is a fold too.
    assert trajs[2].reward == -1.0


def _refused(served, mutate, status=422, match=""):
    ctl, client, headers, lease, codec = served
    group = lease["groups"][0]
    trajs = [play(served, s, i)[0] for i, s in enumerate(SCRIPTS)]
    mutate(trajs, group, codec)
    before = ctl.stats()["groups/buffered"]
    r = submit(client, headers, lease, trajs)
    assert r.status_code == status, r.text
    assert match in r.text, r.text
    assert ctl.stats()["groups/buffered"] == before == 0


@pytest.mark.parametrize("fake", [" opp c. you:", " opp b. you: "])
def test_made_up_environment_tokens_are_refused(served, fake):
    def lie(trajs, group, codec):
        t = trajs[0]  # "c", then the opponent's bet " opp b. you Q:": claim something else
        mask = t["completion_mask"]
        i, n = mask.index(0), mask.count(0)
        assert re.fullmatch(
            r" opp b\. you [JQK]:", codec.decode(t["completion_token_ids"][i : i + n])
        )
        ids = codec.encode(fake)
        t["completion_token_ids"][i : i + n] = ids
        mask[i : i + n] = [0] * len(ids)
        t["logprobs"][i : i + n] = [0.0] * len(ids)
        t["versions"][i : i + n] = [0] * len(ids)

    _refused(served, lie, match="differ from the replay")


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda ts, g, c: ts[0].update(completion_mask=[2] * len(ts[0]["completion_mask"])), ""),
        (lambda ts, g, c: ts[0].update(completion_mask=[True] * len(ts[0]["logprobs"])), ""),
        (lambda ts, g, c: ts[0].update(completion_mask=ts[0]["completion_mask"][:-1]), "entries"),
        (lambda ts, g, c: ts[0].pop("completion_mask"), "needs a completion_mask"),
        (
            lambda ts, g, c: ts[0].update(logprobs=[-0.1] * len(ts[0]["logprobs"])),
            "log-prob 0",
        ),
        (
            lambda ts, g, c: ts[0].update(completion_mask=[0] + ts[0]["completion_mask"][1:]),
            "start and end with a model turn",
        ),
        (
            lambda ts, g, c: ts[2].update(  # a turn after the episode ended (a fold)
                completion_token_ids=ts[2]["completion_token_ids"] + c.encode(" x") + [15],
                completion_mask=ts[2]["completion_mask"] + [0, 0, 1],
                logprobs=ts[2]["logprobs"] + [0.0, 0.0, -0.5],
                versions=ts[2]["versions"] + [0, 0, 0],
            ),
            "its 2 model turns are not the 1 played",
        ),
        (
            lambda ts, g, c: ts[0].update(  # a model turn longer than max_tokens 3
                completion_token_ids=c.encode("cccc") + ts[0]["completion_token_ids"][2:],
                completion_mask=[1, 1, 1, 1] + ts[0]["completion_mask"][2:],
                logprobs=[-0.1] * 4 + ts[0]["logprobs"][2:],
                versions=[0, 0] + ts[0]["versions"],
            ),
            "a model turn has 4 tokens",
        ),
    ],
    ids=["mask-2", "mask-bool", "mask-short", "no-mask", "env-logprob", "env-first",
         "after-done", "long-turn"],
)  # fmt: skip
def test_malformed_episodes_are_refused(served, mutate, match):
    _refused(served, mutate, match=match)


def test_observations_come_from_the_controller_and_the_lease_hides_the_seed(served):
    """Issue 23 item 8: nothing in the lease names the deal (no seed, an opaque prompt id),
    and POST /v1/episode answers each turn's observation from the controller's replay; it
    refuses turns that are not the caller's to ask about, changing nothing."""
    ctl, client, headers, lease, codec = served
    seed = lease["groups"][0]["episode"]["seed"]  # the test's copy, from the database
    r = client.post("/v1/lease", headers=headers, json={"worker_version": 0, "max_groups": 1})
    got = client.post("/v1/heartbeat", headers=headers, json={"worker_version": 0}).text
    for text in (r.text, got):
        assert str(seed) not in text  # no seed anywhere in what a worker is sent
    group = lease["groups"][0]
    env = make_env("kuhn_poker")
    env.reset(seed)
    want, _, done = env.step("c")
    assert not done  # _two_turn_secret: a check, then the opponent bets

    def ask(turns, lease_id=lease["lease_id"], gid=group["group_id"], i=0, h=headers):
        body = {"lease_id": lease_id,
                "episodes": [{"group_id": gid, "sample_index": i, "turns": turns}]}  # fmt: skip
        return client.post("/v1/episode", headers=h, json=body)

    check = codec.encode("c") + [EOS_ID]
    r = ask([check])
    assert r.status_code == 200, r.text
    assert r.json()["observations"] == [{"observation": want, "done": False}]
    r = ask([check, codec.encode("c") + [EOS_ID]])  # check, then call the bet: showdown
    assert r.json()["observations"][0]["done"] and r.json()["observations"][0]["observation"] == ""
    secret = load_or_create_join_secret(os.path.dirname(ctl.db.path))
    other = client.post("/v1/register", json={"join_secret": secret, "profile": PROFILE})
    stranger = {"Authorization": f"Bearer {other.json()['token']}"}
    assert ask([codec.encode("f") + [EOS_ID]], i=1).json()["observations"][0]["done"]
    before = ctl.db.q("SELECT * FROM groups")
    for resp, status in (
        (ask([check], h=stranger), 403),  # another worker's lease
        (ask([check], gid=group["group_id"] + 999), 409),  # a group not in this lease
        (ask([check], i=GROUP), 422),  # a sample the group does not have
        (ask([check] * 3), 422),  # more turns than max_turns
        (ask([[1] * 4]), 422),  # a turn longer than the turn's max_tokens
        (ask([codec.encode("f") + [EOS_ID], check], i=1), 422),  # a turn after the fold
        (ask([check], lease_id="nope"), 404),
    ):
        assert resp.status_code == status, (status, resp.text)
    assert [dict(x) for x in ctl.db.q("SELECT * FROM groups")] == [dict(x) for x in before]


def test_an_episode_cannot_be_rewound_or_probed(served):
    """The controller holds each leased episode's turns: a worker that checked and saw the
    opponent bet (so its card is not the Queen) can neither ask about another line of the
    same episode nor submit one; a retry of the turns played gets the same answer."""
    ctl, client, headers, lease, codec = served
    check, bet = (codec.encode(a) + [EOS_ID] for a in "cb")
    seen = ask(served, [check])
    assert seen.status_code == 200 and not seen.json()["observations"][0]["done"]
    probe = ask(served, [bet])  # the other line, knowing where this one goes
    assert probe.status_code == 409, probe.text  # before: 200, and its outcome
    assert "observations" not in probe.json()
    assert ask(served, [check]).json() == seen.json()  # a retry: the committed answer
    two = ask(served, [check, bet], i=1)  # two turns in one request: a line never played
    assert two.status_code == 422, two.text
    # Submitted: sample 0 as the bet it probed for, the others as played.
    other = play(served, ["b"], 0, commit=False)[0]
    trajs = [other] + [play(served, s, i)[0] for i, s in enumerate(SCRIPTS) if i]
    r = submit(client, headers, lease, trajs)
    assert r.status_code == 422 and "not the 1 played through POST /v1/episode" in r.text
    assert ctl.stats()["groups/buffered"] == 0


def test_one_request_replays_an_episode_once(served):
    """Before, one request naming the same episode 1,024 times got 1,024 replays (and
    stalled the other workers' replays for tens of seconds)."""
    ctl, client, headers, lease, codec = served
    turn = {"group_id": lease["groups"][0]["group_id"], "sample_index": 0,
            "turns": [codec.encode("c") + [EOS_ID]]}  # fmt: skip
    r = client.post("/v1/episode", headers=headers,
                    json={"lease_id": lease["lease_id"], "episodes": [turn] * 1024})  # fmt: skip
    assert r.status_code == 422 and "twice" in r.text, r.text[:300]
    assert ctl.db.episode_states(lease["lease_id"]) == {}  # nothing replayed or committed


@pytest.mark.parametrize(
    "served", [dict(episode_replays_per_s=1e-6, episode_replay_burst=GROUP)], indirect=True
)
def test_replays_have_a_budget_per_worker(served):
    """A worker's replays come out of its own bucket (429 with Retry-After past it, which
    ControllerClient waits out); a retry costs nothing; other workers keep theirs."""
    ctl, client, headers, lease, codec = served
    check, call = (codec.encode(a) + [EOS_ID] for a in "cc")
    gid = lease["groups"][0]["group_id"]

    def turns(lease_id, group_id, ts, h=headers, samples=range(GROUP)):
        body = {"lease_id": lease_id, "episodes": [
            {"group_id": group_id, "sample_index": i, "turns": ts} for i in samples]}  # fmt: skip
        return client.post("/v1/episode", headers=h, json=body)

    assert turns(lease["lease_id"], gid, [check]).status_code == 200  # the whole bucket
    assert turns(lease["lease_id"], gid, [check]).status_code == 200  # a retry: no replay
    r = turns(lease["lease_id"], gid, [check, call], samples=[0])
    assert r.status_code == 429, r.text
    assert float(r.json()["retry_after_s"]) > 0 and int(r.headers["Retry-After"]) >= 1
    assert len(ctl.db.episode_states(lease["lease_id"])[gid, 0][0]) == 1  # not committed
    secret = load_or_create_join_secret(os.path.dirname(ctl.db.path))
    other = client.post("/v1/register", json={"join_secret": secret, "profile": PROFILE})
    h2 = {"Authorization": f"Bearer {other.json()['token']}"}
    got = client.post("/v1/lease", headers=h2, json={"worker_version": 0, "max_groups": 1})
    theirs = got.json()["lease"]
    assert (
        turns(theirs["lease_id"], theirs["groups"][0]["group_id"], [check], h=h2).status_code == 200
    )


def test_prompt_ids_give_nothing_away_and_survive_a_restart(tmp_path, text_codec):
    """An environment's training prompts come from a stream keyed by the run's secret: a
    leased prompt id is in no table a worker can build from the public seeds (before: the
    first lease's id was the public stream's first, so its deal could be looked up), while
    a controller restarted on its database continues the same stream."""
    import shutil

    task = make_task("kuhn_poker")
    ctl = Controller(ControllerConfig(staleness=1, groups_per_step=1, group_size=2,
                                      vocab_size=100, seed=0),
                     os.path.join(tmp_path, "a.db"), task, codec=text_codec)  # fmt: skip
    server = serve_controller(ctl, str(tmp_path), ServerOptions())
    secret = load_or_create_join_secret(str(tmp_path))
    with httpx.Client(base_url=server.url, timeout=60) as client:
        r = client.post("/v1/register", json={"join_secret": secret, "profile": PROFILE})
        headers = {"Authorization": f"Bearer {r.json()['token']}"}
        ctl.publish(0)
        r = client.post("/v1/lease", headers=headers, json={"worker_version": 0, "max_groups": 1})
        first = r.json()["lease"]["groups"][0]["prompt_id"]
    server.stop()
    ctl.close()
    public = {p.prompt_id for s in range(4) for p in itertools.islice(task.train_prompts(s), 4096)}
    public |= {p.prompt_id for p in task.eval_prompts()}
    assert first not in public

    def next_prompt(path):
        c = Controller(ControllerConfig(staleness=1, groups_per_step=1, group_size=2,
                                        vocab_size=100, seed=0), path, task,
                       codec=text_codec)  # fmt: skip
        try:
            wid, _ = c.register(WorkerProfile(**PROFILE))
            c.publish(0)
            return c.lease(wid, LeaseRequest(worker_version=0, max_groups=1)).lease.groups[0]
        finally:
            c.close()

    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(os.path.join(tmp_path, "a.db" + suffix)):
            shutil.copy(os.path.join(tmp_path, "a.db" + suffix),
                        os.path.join(tmp_path, "b.db" + suffix))  # fmt: skip
    again = next_prompt(os.path.join(tmp_path, "a.db"))
    assert again.prompt_id not in public | {first}
    assert next_prompt(os.path.join(tmp_path, "b.db")).prompt_id == again.prompt_id
    assert next_prompt(os.path.join(tmp_path, "c.db")).prompt_id not in {first, again.prompt_id}


def test_a_single_turn_group_refuses_environment_tokens(tmp_path, text_codec):
    from bridge.control.intake.validation import SubmissionError, check_group
    from bridge.control.protocol import GroupResult, WorkerTrajectory

    ids = text_codec.encode_prompt("1+1=")
    traj = WorkerTrajectory(
        prompt_id="p",
        sample_index=0,
        prompt_token_ids=ids,
        completion_token_ids=[5, 6, EOS_ID],
        logprobs=[-0.1, 0.0, -0.1],
        versions=[0, 0, 0],
        finish_reason="stop",
        completion_mask=[1, 0, 1],
    )
    kw = dict(
        prompt_id="p",
        n=1,
        sampling=SamplingParams(max_tokens=8),
        vocab_size=100,
        max_prompt_tokens=16,
        newest_version=0,
        prompt_token_ids=ids,
    )
    with pytest.raises(SubmissionError, match="single-turn"):
        check_group(GroupResult(group_id=0, trajectories=[traj]), **kw)
    ok = traj.model_copy(update={"completion_mask": [1, 1, 1]})
    check_group(GroupResult(group_id=0, trajectories=[ok]), **kw)


GUESS_ENV = '''
import random
from bridge.tasks import Environment, register_env

@register_env("guess", max_turns=4, turn_max_tokens=2)
class Guess(Environment):
    """The README's example: guess a digit; each wrong guess is told higher/lower."""
    def reset(self, seed):
        self.secret = random.Random(seed).randrange(10)
        return "Guess 0-9:"
    def step(self, action):
        g = action.strip()[:1]
        if g == str(self.secret):
            return " yes.", 1.0, True
        return (" higher:" if g.isdigit() and int(g) < self.secret else " lower:"), 0.0, False
'''


def test_a_users_environment_from_its_own_module(tmp_path, text_codec, monkeypatch):
    """The README's environment class in a module of the user's: the task is built by name
    with `module=`, the lease tells a worker which module registers the env, and the
    controller's replay (in a reward pool started after the module is importable) finds
    it too."""
    from bridge.control.protocol import EpisodeStep, EpisodeTurns, Submission
    from bridge.tasks.reward_pool import RewardPool

    (tmp_path / "guess_env_mod.py").write_text(GUESS_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    task = make_task("guess", module="guess_env_mod")
    pool = RewardPool(processes=1)
    ctl = Controller(
        ControllerConfig(
            groups_per_step=1,
            group_size=2,
            vocab_size=100,
            sampling=SamplingParams(max_tokens=8, stop_token_ids=[EOS_ID]),
            max_completion_tokens=40,
        ),
        os.path.join(tmp_path, "controller.db"),
        task,
        codec=text_codec,
        reward_pool=pool,
    )
    try:
        wid, _ = ctl.register(WorkerProfile(**PROFILE))
        ctl.publish(0)
        group = ctl.lease(wid, LeaseRequest(worker_version=0)).lease.groups[0]
        assert group.episode.module == "guess_env_mod" and group.sampling.max_tokens == 2
        # Sample 0 guesses upward; sample 1 says something that is not a digit, once.
        env = make_env("guess")
        trajs, rewards = [], []
        seed = int(ctl.db.groups_in("leased")[0]["answer"])  # hidden from the lease (-1)
        lease_id = ctl.db.active_leases(wid)[0]
        for guesses in (["0", "1", "2", "3"], ["x"]):
            ids, mask, total = [], [], 0.0
            env.reset(seed)
            turns = []
            for i, g in enumerate(guesses):
                ids, mask = ids + text_codec.encode(g), mask + [1]
                turns.append(text_codec.encode(g))
                obs, r, done = env.step(g)
                total += r
                # Each turn played on the controller too (the turns it will accept).
                ep = EpisodeTurns(group_id=group.group_id, sample_index=len(trajs), turns=turns)
                got = ctl.episode_step(wid, EpisodeStep(lease_id=lease_id, episodes=[ep]))
                assert got.observations[0].done == done
                if done or i == len(guesses) - 1:
                    break
                shown = text_codec.encode(obs)
                ids, mask = ids + shown, mask + [0] * len(shown)
            trajs.append(
                dict(
                    prompt_id=group.prompt_id,
                    sample_index=len(trajs),
                    prompt_token_ids=group.prompt_token_ids,
                    completion_token_ids=ids,
                    logprobs=[-0.5 if m else 0.0 for m in mask],
                    versions=[0] * len(ids),
                    finish_reason="stop" if done else "length",
                    completion_mask=mask,
                )
            )
            rewards.append(total)
        sub = Submission(
            lease_id=lease_id,
            groups=[{"group_id": group.group_id, "trajectories": trajs}],
        )
        assert ctl.submit(wid, sub).accepted == [group.group_id]
        batch, _ = ctl.take_batch(0, 1)
        got = sorted(batch[0].trajectories, key=lambda t: t.sample_index)
        assert [t.reward for t in got] == rewards and [t.reward_error for t in got] == ["", ""]
    finally:
        ctl.close()
        pool.close()


BARRIER_ENV = """
import threading
from bridge.tasks import Environment, register_env

BARRIER = threading.Barrier(2, timeout=60)  # a deadlock guard, not a timing

@register_env("barrier_guess", max_turns=4, turn_max_tokens=2)
class BarrierGuess(Environment):
    \"\"\"Guess a digit; each step waits until a second replay reaches a step too.\"\"\"
    def reset(self, seed):
        self.secret = seed % 10
        return "Guess 0-9:"
    def step(self, action):
        BARRIER.wait()
        g = action.strip()[:1]
        if g == str(self.secret):
            return " yes.", 1.0, True
        return (" higher:" if g.isdigit() and int(g) < self.secret else " lower:"), 0.0, False
"""


def test_two_lines_played_at_once_commit_one(tmp_path, text_codec, monkeypatch):
    """Two requests playing different first turns of one episode at the same moment (each
    replay waits until the other has started): one is answered and committed, the other
    refused (409), so concurrent requests are no way to probe two lines."""
    import concurrent.futures

    (tmp_path / "barrier_env_mod.py").write_text(BARRIER_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    task = make_task("barrier_guess", module="barrier_env_mod")
    config = ControllerConfig(groups_per_step=1, group_size=2, vocab_size=100,
                              sampling=SamplingParams(max_tokens=8, stop_token_ids=[EOS_ID]),
                              max_completion_tokens=40, reward_timeout_s=0.0)  # fmt: skip
    # reward_timeout_s 0: replays inline, in the server's request threads (the barrier's)
    ctl = Controller(config, os.path.join(tmp_path, "c.db"), task, codec=text_codec)
    server = serve_controller(ctl, str(tmp_path), ServerOptions())
    secret = load_or_create_join_secret(str(tmp_path))
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            r = client.post("/v1/register", json={"join_secret": secret, "profile": PROFILE})
            headers = {"Authorization": f"Bearer {r.json()['token']}"}
            ctl.publish(0)
            r = client.post("/v1/lease", headers=headers, json={"worker_version": 0})
            lease = r.json()["lease"]
            gid = lease["groups"][0]["group_id"]

            def line(guess):
                body = {"lease_id": lease["lease_id"], "episodes": [
                    {"group_id": gid, "sample_index": 0,
                     "turns": [text_codec.encode(guess)]}]}  # fmt: skip
                return client.post("/v1/episode", headers=headers, json=body)

            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                got = list(pool.map(line, ["1", "8"]))
        assert sorted(r.status_code for r in got) == [200, 409], [r.text for r in got]
        turns = ctl.db.episode_states(lease["lease_id"])[gid, 0][0]
        won = ["1", "8"][[r.status_code for r in got].index(200)]
        assert turns == [text_codec.encode(won)]
    finally:
        server.stop()
        ctl.close()
