"""Per-token version labels checked against the weights that produced them.

Real rollout workers (`RolloutWorker` in-process on the session's vLLM engine) generate for
a real controller on loopback: one lease under version 0 (the engine's own weights), then,
after version 1 (other weights) is published, one lease under version 1. The learner's
batch (`take_batch`) thus carries trajectories tagged with two distinct versions. Each is
re-scored by the learner's audit re-scorer (learner_jax/rl/rescore.py: the version read
back from the weight store, the JAX model) under the version it is tagged with:

- every token's behaviour log-prob matches within the vLLM parity tolerance (1e-3, as in
  engine_test), and the per-worker audit sums (`VersionRescorer.maybe`, the train binary's
  path) stay far below the audit's quarantine thresholds;
- the same trajectories with their tags shifted to the other version disagree beyond that
  tolerance in every row, and the audit sums of a worker that shifted them pass its
  KL threshold.

Would catch: a worker tagging tokens with a version other than the one it generated with
(or swapping mid-lease), the re-scorer reading another version than the rows' (e.g. the
oldest for all), re-scoring rows of another version under the chosen one, and an audit
that cannot tell the two versions apart.
"""

import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bridge.contracts.prompt import TextCodec
from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.http.service import ServerOptions, load_or_create_join_secret, serve_controller
from bridge.control.protocol import SamplingParams, WorkerProfile
from bridge.control.trust import audit
from bridge.model import tiny_model
from bridge.store.weight_store import WeightStore
from bridge.tasks import make_task
from learner_jax.model import model
from learner_jax.rl.rescore import VersionRescorer

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
]

TOL = 1e-3  # vLLM (fp32) vs an independent fp32 implementation, per token (engine_test)
GROUP_SIZE, MAX_TOKENS = 2, 8
CFG = tiny_model.tiny_config("qwen3")


def serve(workdir):
    """A controller on loopback for the tiny model's tokenizer (arithmetic prompts)."""
    config = ControllerConfig(
        staleness=4,  # both versions' groups are fresh at learner step 1
        groups_per_step=2,
        group_size=GROUP_SIZE,
        sampling=SamplingParams(max_tokens=MAX_TOKENS),
        vocab_size=CFG.vocab_size,
        lease_ttl_s=120.0,  # expiry must not end a lease here
        heartbeat_interval_s=0.5,
    )
    tokenizer = os.path.join(workdir, "tokenizer")
    os.makedirs(tokenizer, exist_ok=True)
    tiny_model.save_tokenizer(tokenizer)
    db = os.path.join(workdir, "controller.db")
    ctl = Controller(config, db, make_task("arithmetic"), codec=TextCodec(tokenizer))
    return ctl, serve_controller(ctl, workdir, ServerOptions(host="127.0.0.1", port=0))


def run_one_lease(server, workdir, engine, cache_dir):
    """A worker that joins, loads the newest version, submits one lease and leaves."""
    from rollout_gpu.worker import RolloutWorker, WorkerOptions

    opts = WorkerOptions(
        relay=False,
        controller=server.url,
        join_secret=load_or_create_join_secret(workdir),
        profile=WorkerProfile(accelerator="cpu", price_per_hour=0.0, max_concurrent_sequences=8),
        max_leases=1,
        cache_dir=cache_dir,
    )
    worker = RolloutWorker(opts, engine=engine)
    thread = threading.Thread(target=worker.run, daemon=True, name="worker")
    thread.start()
    thread.join(timeout=180)  # a hang guard: one lease of 8 tokens takes well under a second
    assert not thread.is_alive() and worker.leases_done == 1
    return worker.session.worker_id


WIDTH = 64  # prompt + completion tokens, padded: one compilation for every row


@jax.jit
def _logprobs(params, ids, seg):  # ids, seg [1, WIDTH] -> [1, WIDTH - 1]
    pos = jnp.arange(WIDTH - 1, dtype=jnp.int32)[None]
    return model.forward_logprobs(params, CFG, ids[:, :-1], pos, seg[:, :-1], ids[:, 1:])


def learner_logprobs(params, t):
    """The JAX model's log-probs of `t`'s completion under `params` (causal: the padding
    after the row changes nothing before it)."""
    p, c = list(t.prompt_token_ids), list(t.completion_token_ids)
    ids = np.zeros((1, WIDTH), np.int32)
    ids[0, : len(p) + len(c)] = p + c
    seg = (np.arange(WIDTH) < len(p) + len(c)).astype(np.int32)[None]
    lp = np.asarray(jax.device_get(_logprobs(params, ids, seg)), np.float64)
    return lp[0, len(p) - 1 : len(p) + len(c) - 1]


def tagged(groups, version, worker_id=None):
    """The groups with every token tagged `version` (and credited to `worker_id`)."""
    out = []
    for g in groups:
        ts = [
            t.model_copy(update={"versions": [version] * len(t.versions)}) for t in g.trajectories
        ]
        out.append(g.model_copy(update={"trajectories": ts, "worker_id": worker_id or g.worker_id}))
    return out


def test_tokens_rescore_under_their_tagged_version_and_a_shifted_tag_is_caught(
    vllm_engine, tmp_path
):
    workdir = str(tmp_path)
    spec = f"file://{workdir}/store"
    store = WeightStore(spec)
    ctl, server = serve(workdir)
    cache = str(tmp_path / "cache")
    try:
        # Version 0 = the engine's own weights (seed 0); version 1 = other weights, larger so
        # that the two versions' log-probs differ by much more than the tolerance.
        w0 = tiny_model.random_hf_weights(CFG, seed=0)
        store.publish(0, 0, w0.items(), model_config=CFG.to_hf_dict(), dtype="float32")
        ctl.publish(0, store=spec)
        first = run_one_lease(server, workdir, vllm_engine, cache)
        w1 = tiny_model.random_hf_weights(CFG, seed=5, std=0.1)
        store.publish(1, 1, w1.items(), model_config=CFG.to_hf_dict(), dtype="float32")
        ctl.publish(1, store=spec)
        second = run_one_lease(server, workdir, vllm_engine, cache)
    finally:
        # Give the session engine back with the weights it was started with.
        from rollout_gpu import weight_swap

        weight_swap.restore(vllm_engine, weight_swap.EngineVersion())
        server.stop()

    try:
        n = ctl.db.count("buffered")
        batch, _ = ctl.take_batch(1, n)
    finally:
        ctl.close()
    assert batch is not None and n >= 2
    by_version = {}
    for g in batch:
        vs = {v for t in g.trajectories for v in t.versions}
        assert len(vs) == 1, vs  # a lease is generated under one version
        by_version.setdefault(vs.pop(), []).append(g)
    assert sorted(by_version) == [0, 1]  # at least two distinct versions consumed
    assert {g.worker_id for g in by_version[0]} == {first}
    assert {g.worker_id for g in by_version[1]} == {second}

    rescorer = VersionRescorer(store, CFG, every=1, max_rows=64)
    params = {v: rescorer.params(v) for v in by_version}  # read back from the weight store
    for v, groups in by_version.items():
        for g in groups:
            for t in g.trajectories:
                assert len(t.prompt_token_ids) + len(t.completion_token_ids) <= WIDTH
                behaviour = np.asarray(t.logprobs, np.float64)
                same = np.abs(behaviour - learner_logprobs(params[v], t))
                other = np.abs(behaviour - learner_logprobs(params[1 - v], t))
                assert same.max() <= TOL, (v, same.max())
                assert other.max() > 10 * TOL, (v, other.max())  # the shifted tag disagrees

    # The audit's path: `maybe` re-scores every version the rows carry, per worker.
    thresholds = audit.AuditConfig()

    def stats(groups, current):
        return {s.worker_id: s for s in rescorer.maybe(1, groups, current_version=current)}

    honest = stats(batch, 2)  # versions 0 and 1 alike, not only the oldest
    assert set(honest) == {first, second}
    assert honest[first].version == 0 and honest[second].version == 1
    for s in honest.values():
        assert s.tokens == sum(
            len(t.versions) for g in by_version[s.version] for t in g.trajectories
        )
        assert s.sum_k3 / s.tokens < 1e-6, s  # fp32 vs fp32: numerics only
        assert abs(s.sum_logratio) / s.tokens < TOL, s
    shifted = {
        **stats(tagged(by_version[1], 0, "claims_v0"), 2),
        **stats(tagged(by_version[0], 1, "claims_v1"), 2),
    }
    assert set(shifted) == {"claims_v0", "claims_v1"}
    for s in shifted.values():
        assert s.sum_k3 / s.tokens > thresholds.kl_threshold, s
