"""Issue 23 item 6 end to end: workers that choose their tokens themselves and report the
policy's TRUE log-probs of them are quarantined by the sampling check; an honest one is not.

Three workers speak HTTP to a real controller on loopback, all under version 0 (weights
peaked enough that choosing tokens shows: std 0.2), interleaved lease by lease:

- honest: the session's vLLM engine with version 0 swapped in from the weight store (the
  worker's own path, `weight_swap.load_version`) samples and reports its log-probs;
- greedy: the likeliest token at each position (transformers on the same weights), with
  its true log-prob;
- reference: the right answer of each arithmetic prompt, the tokens that score, with their
  true log-probs.

The log-prob audit (k3) sees nothing wrong with either cheater: their log-probs are the
policy's. The real learner (`Learner`, the tiny-arith RL step) then trains on the
controller's batches (`BatchSource`) with the training binary's audit hook (`hooks.Audit`:
the train step's rows of its own version, and the re-score of older ones, every step
here): the greedy worker's rows are on-policy in step 1 (the train step's sums), the
reference worker's come later, off-policy (the re-score's sums). Asserted: both cheaters
are quarantined for their sampling Z while their k3 stays far below its threshold, the
honest worker is audited past `audit_min_tokens` and stays in, no batch after a
quarantine holds a group of the quarantined worker (its buffered groups were dropped:
some were), and its token is dead (401).
"""

import dataclasses
import os
import re

import httpx
import pytest
from safetensors.numpy import save_file

from bridge.contracts.prompt import TextCodec
from bridge.contracts.sampling_check import Z_MAX
from bridge.control.http.service import ServerOptions, load_or_create_join_secret, serve_controller
from bridge.model import tiny_model
from bridge.store.weight_store import WeightStore
from bridge.tasks import make_task
from learner_jax import config_file, run_config, train
from learner_jax.rl import batches, hooks, rescore, serve

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
CFG = tiny_model.tiny_config("qwen3")  # the session engine's architecture
GROUPS_PER_LEASE, N, MAX_TOKENS, ROUNDS = 2, 4, 12, 5
PROFILE = {"accelerator": "cpu", "price_per_hour": 0.0, "max_concurrent_sequences": 8}


def peaked_model(path):
    """A tiny model dir whose next-token distributions are far from flat."""
    tiny_model.make_tiny_model(str(path), CFG)
    weights = tiny_model.random_hf_weights(CFG, seed=3, std=0.2)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path), weights


def learner_config(model_dir):
    c = config_file.load_config(os.path.join(ROOT, "configs", "test_tiny.py"))
    c.model.hf_dir, c.model.dtype = model_dir, "float32"
    c.sft.steps, c.total_steps, c.staleness = 0, 50, 50
    c.batch.groups_per_step, c.batch.samples_per_group = 4, N
    c.batch.micro_batch_size, c.batch.max_prompt_len, c.batch.max_answer_len = 16, 16, MAX_TOKENS
    c.checkpoint.interval = 1000
    c.rollout.eval_period = 0
    return c


class TrueLogprobs:
    """transformers fp32 (float64 log-softmax) on the published weights: what a cheater with
    the model can compute, the policy's exact log-probs at temperature 1."""

    def __init__(self, model_dir):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logp(self, ids):
        with self.torch.no_grad():
            logits = self.hf(input_ids=self.torch.tensor([ids])).logits[0].double()
        return self.torch.log_softmax(logits, -1).numpy()  # [len(ids), V]

    def greedy(self, prompt):
        ids, lps = list(prompt), []
        for _ in range(MAX_TOKENS):
            row = self.logp(ids)[-1]
            ids.append(int(row.argmax()))
            lps.append(float(row.max()))
            if ids[-1] == tiny_model.EOS_ID:
                break
        return ids[len(prompt) :], lps

    def forced(self, prompt, completion):
        rows = self.logp(list(prompt) + list(completion))
        return [float(rows[len(prompt) - 1 + i, t]) for i, t in enumerate(completion)]


def answer_ids(prompt_text):
    a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)=", prompt_text).groups()
    value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    vocab = tiny_model.char_vocab()
    return [vocab[ch] for ch in str(value)] + [tiny_model.EOS_ID]


class Worker:
    """One worker over HTTP; `make(group) -> [(completion ids, log-probs, finish)] * n`."""

    def __init__(self, client, secret, make):
        r = client.post("/v1/register", json={"join_secret": secret, "profile": PROFILE})
        assert r.status_code == 200, r.text
        self.id, self.client, self.make = r.json()["worker_id"], client, make
        self.headers = {"Authorization": f"Bearer {r.json()['token']}"}

    def lease(self):
        body = {"worker_version": 0, "max_groups": GROUPS_PER_LEASE}
        return self.client.post("/v1/lease", headers=self.headers, json=body)

    def one_lease(self):
        r = self.lease()
        assert r.status_code == 200 and r.json()["lease"], r.text
        lease = r.json()["lease"]
        out = []
        for g in lease["groups"]:
            trajs = [
                dict(prompt_id=g["prompt_id"], sample_index=i,
                     prompt_token_ids=g["prompt_token_ids"], completion_token_ids=ids,
                     logprobs=lps, versions=[0] * len(ids), finish_reason=finish)
                for i, (ids, lps, finish) in enumerate(self.make(g))
            ]  # fmt: skip
            out.append({"group_id": g["group_id"], "trajectories": trajs})
        body = {"lease_id": lease["lease_id"], "groups": out}
        r = self.client.post("/v1/submit", headers=self.headers, json=body)
        assert r.status_code == 200 and len(r.json()["accepted"]) == len(out), r.text


def finish(ids):
    return "stop" if ids[-1] == tiny_model.EOS_ID else "length"


def honest_sampler(engine):
    from rollout_gpu.engine import SampleRequest

    def make(g):
        req = SampleRequest(prompt_token_ids=g["prompt_token_ids"], n=g["n"],
                            max_tokens=MAX_TOKENS, temperature=1.0,
                            stop_token_ids=[tiny_model.EOS_ID], seed=g["group_id"])  # fmt: skip
        [completions] = engine.generate([req])
        return [(list(c.token_ids), list(c.logprobs), finish(c.token_ids)) for c in completions]

    return make


class Recorder:
    """After each step (after the audit hook): whose groups the step trained on, who is
    quarantined now; stops the stream once too few groups are left for a batch."""

    def __init__(self, ctl, source, groups_per_step):
        self.ctl, self.source, self.need = ctl, source, groups_per_step
        self.steps, self.stop = [], False

    def after_step(self, learner, metrics):
        with self.ctl.lock:
            quarantined = set(self.ctl.db.quarantined())
            self.stop = self.ctl.db.count("buffered") < self.need
        self.steps.append(
            (learner.step, {g.worker_id for g in self.source.last_groups}, quarantined)
        )


def test_token_pickers_with_true_logprobs_are_quarantined_honest_sampler_is_not(
    vllm_engine, tmp_path
):
    from learner_jax.learner import Learner
    from rollout_gpu import weight_swap

    workdir = str(tmp_path / "run")
    os.makedirs(workdir)
    model_dir, weights = peaked_model(tmp_path / "model")
    config = learner_config(model_dir)
    codec = TextCodec(model_dir)
    cfg = dataclasses.replace(
        run_config.controller_config(config, CFG.vocab_size, codec.eos_id),
        audit_min_tokens=64, max_groups_per_lease=GROUPS_PER_LEASE, lease_ttl_s=600.0,
        worker_timeout_s=600.0, refuse_too_slow=False,
    )  # fmt: skip
    ctl = serve.open_controller(cfg, workdir, make_task("arithmetic"), codec, None, 0)
    server = serve_controller(ctl, workdir, ServerOptions(host="127.0.0.1", port=0))
    spec = f"file://{workdir}/weights"
    store = WeightStore(spec)
    store.publish(0, 0, weights.items(), model_config=CFG.to_hf_dict(), dtype="float32")
    ctl.publish(0, store=spec)
    scorer = TrueLogprobs(model_dir)
    current = weight_swap.EngineVersion()
    learner = None
    try:
        weight_swap.load_version(vllm_engine, store, 0, current)  # the worker's swap path
        with httpx.Client(base_url=server.url, timeout=60) as client:
            secret = load_or_create_join_secret(workdir)

            def greedy(g):
                ids, lps = scorer.greedy(g["prompt_token_ids"])
                return [(ids, lps, finish(ids))] * g["n"]

            def reference(g):
                ids = answer_ids(g["prompt"])
                return [(ids, scorer.forced(g["prompt_token_ids"], ids), "stop")] * g["n"]

            honest = Worker(client, secret, honest_sampler(vllm_engine))
            cheats = {"greedy": Worker(client, secret, greedy),
                      "reference": Worker(client, secret, reference)}  # fmt: skip
            # Accepted in this order, and batches follow it: H G R H G R ... H H.
            for _ in range(ROUNDS):
                for w in (honest, cheats["greedy"], cheats["reference"]):
                    w.one_lease()
            honest.one_lease()
            honest.one_lease()

            learner = Learner(config, workdir)
            source = batches.BatchSource(
                ctl, run_config.batch_shape(config), run_config.advantage_config(config),
                codec.pad_id, lambda: learner.step, timeout_s=60.0,
                should_stop=lambda: recorder.stop,
            )  # fmt: skip
            recorder = Recorder(ctl, source, config.batch.groups_per_step)
            rescorer = rescore.VersionRescorer(store, learner.model_cfg, every=1, max_rows=64)
            train.run_rl(learner, source, [hooks.Audit(ctl, source, rescorer), recorder])

            for w in cheats.values():  # a quarantined worker's token is dead
                assert w.lease().status_code == 401
            assert honest.lease().status_code == 200
    finally:
        weight_swap.restore(vllm_engine, weight_swap.EngineVersion())
        if learner is not None:
            learner.close()
        server.stop()

    with ctl.lock:
        quarantine = ctl.db.quarantined()
        scores = {w.id: ctl.auditor.score(w.id) for w in (honest, *cheats.values())}
    ctl.close()
    print({name: scores[w.id] for name, w in (("honest", honest), *cheats.items())})
    print([(step, sorted(ws), sorted(q)) for step, ws, q in recorder.steps])
    assert set(quarantine) == {w.id for w in cheats.values()}, quarantine
    for name, w in cheats.items():
        assert "sampled tokens" in quarantine[w.id]["why"], (name, quarantine[w.id]["why"])
        # Their log-probs are the policy's: the log-prob audit alone passes them.
        assert scores[w.id]["kl"] < cfg.audit_kl_threshold / 100, (name, scores[w.id])
        caught = min(step for step, _, q in recorder.steps if w.id in q)
        trained_after = [step for step, ws, _ in recorder.steps if step > caught and w.id in ws]
        assert trained_after == [], (name, caught, trained_after)
        assert quarantine[w.id]["dropped_groups"] > 0, name  # it had groups waiting
        print(f"{name}: quarantined after step {caught}, Z {scores[w.id]['sampling_z']:+.1f}")
    greedy_caught = min(s for s, _, q in recorder.steps if cheats["greedy"].id in q)
    ref_caught = min(s for s, _, q in recorder.steps if cheats["reference"].id in q)
    assert greedy_caught == 1  # on-policy rows: the train step's sums
    assert ref_caught > 1  # off-policy rows only: the re-score's sums
    assert scores[honest.id]["tokens"] >= cfg.audit_min_tokens  # judged, and passed
    assert abs(scores[honest.id]["sampling_z"]) < Z_MAX
    assert any(honest.id in ws for step, ws, _ in recorder.steps if step > ref_caught)
