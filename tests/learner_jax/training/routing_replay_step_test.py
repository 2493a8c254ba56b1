"""Recorded routing from the wire through the RL step: trajectories carrying routed_experts
become `Batch.routing`, the step replays it (a silent fallback to the learner's own routing
would show in `mismatch/kl`), reports the KL under both routings, and its per-row routing
agreement lets the controller's audit quarantine a worker that forged its routing while an
honest one (its routing the learner's own) stays.

The "engine" here is the learner itself (same params, float32): its behaviour log-probs are
the learner's under the routing it recorded, so with replay the mismatch is float noise,
and every disagreement is the forger's.
"""

import dataclasses

import jax
import numpy as np
import pytest
from controller_helpers import make

from bridge.contracts import routing
from bridge.control.protocol import ConsumedGroup, RoutedExperts, Trajectory, WorkerProfile
from bridge.control.trust.audit import row_sums_to_worker_stats
from bridge.model import tiny_model
from learner_jax.model import model, sharding
from learner_jax.training import advantages, optim, rollout_batch, train_state, train_step

CFG = tiny_model.tiny_config("qwen3_moe")
K, E, L = CFG.num_experts_per_tok, CFG.num_experts, len(CFG.moe_layers)
GROUPS, N, P, A = 2, 4, 5, 8  # groups, samples a group, prompt tokens, max answer tokens
OPT = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-3, warmup_steps=0))
ADV = advantages.AdvantageConfig()


def trajectories(seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for g in range(GROUPS):
        prompt = [tiny_model.BOS_ID] + rng.integers(3, 90, P - 1).tolist()
        for i in range(N):
            c = int(rng.integers(3, A + 1))
            out.append((g, i, prompt, rng.integers(3, 90, c).tolist()))
    return out


def groups_of(trajs, logprobs=None, records=None):
    groups = []
    for g in range(GROUPS):
        ts = []
        for r, (gg, i, p, c) in enumerate(trajs):
            if gg != g:
                continue
            rec = None if records is None else RoutedExperts(**routing.encode(records[r]))
            lp = [-1.0] * len(c) if logprobs is None else logprobs[r]
            ts.append(
                Trajectory(
                    prompt_id=f"p{g}",
                    sample_index=i,
                    prompt_token_ids=p,
                    completion_token_ids=c,
                    logprobs=lp,
                    versions=[0] * len(c),
                    finish_reason="length",
                    reward=float(i),
                    routed_experts=rec,
                )
            )
        groups.append(ConsumedGroup(group_id=g, prompt_id=f"p{g}", prompt="", answer="",
                                    trajectories=ts))  # fmt: skip
    return groups


def to_batch(groups):
    return rollout_batch.groups_to_batch(groups, N, P, A, 0, ADV)[0]


def test_forged_routing_is_replayed_measured_and_its_worker_quarantined(tmp_path):
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    _, shardings = train_state.state_shardings(CFG, OPT, mesh)
    state = train_state.create_train_state(CFG, OPT, mesh, seed=0)
    params = jax.device_get(state.params)
    net = model.Transformer(CFG)
    trajs = trajectories()
    plain = to_batch(groups_of(trajs))
    _, seen = model.token_stats_and_routing(
        net, params, plain.tokens, plain.positions, plain.segment_ids, plain.targets
    )
    own = np.asarray(seen.experts)  # [B, T, L, k] the learner's own top-k
    rng = np.random.default_rng(1)
    records, forged_rows = [], range(N, 2 * N)  # group 1's worker forges
    for r, (_, _, p, c) in enumerate(trajs):
        rows = routing.num_rows(len(p), len(c))
        rec = own[r, :rows].copy()
        if r in forged_rows:
            rec = np.stack([[rng.permutation(E)[:K] for _ in range(L)] for _ in range(rows)])
        records.append(rec)
    # The "engine's" log-probs: the learner's own under the routing it recorded.
    recorded = to_batch(groups_of(trajs, records=records))
    np.testing.assert_array_equal(recorded.routing[0, : len(records[0])], records[0])
    logp = np.asarray(model.token_stats_and_routing(
        net, params, recorded.tokens, recorded.positions, recorded.segment_ids,
        recorded.targets, routing=recorded.routing)[0][0])  # fmt: skip
    behaviour = [logp[r, len(p) - 1 : len(p) + len(c) - 1].tolist()
                 for r, (_, _, p, c) in enumerate(trajs)]  # fmt: skip
    batch = to_batch(groups_of(trajs, behaviour, records))
    assert batch.routing is not None and batch.on_policy.all()
    step_cfg = train_step.StepConfig(routing_replay="rollout", sampling_check=False)
    step = train_step.jit_step(CFG, OPT, step_cfg, mesh, shardings, donate=False)
    _, out = step(state, train_step.put_batch(batch, mesh))
    out = jax.device_get(out)
    # Replayed, the learner scores what the engine scored (float32 rounding: the same
    # params along two jit paths); its own routing does not, on the forged rows. A step
    # that fell back to its own routing would report the latter as mismatch/kl.
    kl, without = float(out["mismatch/kl"]), float(out["mismatch/kl_no_replay"])
    assert float(out["mismatch/kl_replay"]) == kl
    assert kl < 1e-9 and without > 100 * kl, (kl, without)
    agree = np.asarray(out[train_step.ROWS + "routing_agree"])
    rows = np.asarray(out[train_step.ROWS + "routing_tokens"])
    want_rows = [L * routing.num_rows(len(p), len(c)) for _, _, p, c in trajs]
    np.testing.assert_array_equal(rows, want_rows)  # recorded positions only
    honest = agree[:N] / rows[:N]
    assert honest.min() == 1.0, honest  # the filler after the last token is not judged
    assert (agree[N:] / rows[N:]).max() < 0.6  # random experts agree ~k/E = 0.25
    ctl = make(tmp_path, audit_routing_min_rows=int(rows.sum()) // 4)
    profile = WorkerProfile(accelerator="cpu", price_per_hour=1.0, max_concurrent_sequences=8)
    good, _ = ctl.register(profile, identity="cred:good")
    bad, _ = ctl.register(profile, identity="cred:bad")
    tokens = np.asarray(out[train_step.ROWS + "tokens"])
    stats = row_sums_to_worker_stats(
        [good] * N + [bad] * N, tokens > 0, np.zeros(2 * N), np.zeros(2 * N), tokens,
        version=0, row_routing_agree=agree, row_routing_rows=rows,
    )  # fmt: skip
    assert ctl.audit(stats) == [bad]
    assert "recorded MoE routing far from the learner's own" in ctl.db.quarantined()[bad]["why"]
    ctl.close()


def test_replay_off_still_measures_both():
    """With replay off the step's mismatch/kl is the no-replay one, and the replayed KL is
    still reported (the other forward)."""
    batch = to_batch(groups_of(trajectories(2), records=None))
    assert batch.routing is None
    own = np.broadcast_to(np.arange(K, dtype=np.int32), (*batch.tokens.shape, L, K)).copy()
    batch = dataclasses.replace(batch, routing=own)
    mesh = sharding.make_mesh({"data": 1}, jax.devices()[:1])
    _, shardings = train_state.state_shardings(CFG, OPT, mesh)
    state = train_state.create_train_state(CFG, OPT, mesh, seed=0)
    step = train_step.jit_step(CFG, OPT, train_step.StepConfig(sampling_check=False), mesh,
                               shardings, donate=False)  # fmt: skip
    out = jax.device_get(step(state, train_step.put_batch(batch, mesh))[1])
    assert float(out["mismatch/kl_no_replay"]) == float(out["mismatch/kl"])
    assert float(out["mismatch/kl_replay"]) != float(out["mismatch/kl"])


def test_a_batch_with_some_rows_unrecorded_is_refused():
    trajs = trajectories(3)
    records = [
        np.zeros((routing.num_rows(len(p), len(c)), L, K), np.int32) + np.arange(K)
        for _, _, p, c in trajs
    ]
    groups = groups_of(trajs, records=records)
    t = groups[1].trajectories[2]
    groups[1].trajectories[2] = t.model_copy(update={"routed_experts": None})
    with pytest.raises(ValueError, match="1 of 8 trajectories carry no routing"):
        to_batch(groups)
