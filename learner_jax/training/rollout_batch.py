"""Controller groups -> one fixed-shape learner `Batch` (GRPO rows with advantages).

Each trajectory becomes one row `prompt ids + completion ids`, right-padded to
`max_prompt_len + max_answer_len + 1` (the SFT row width, so both phases share shapes).
The loss covers the model's completion tokens only: for a multi-turn episode the
environment's observation tokens in the completion have `completion_mask` 0 and stay out
of the loss, the importance weights, `mismatch/kl` and the audit (they are context, not
actions; every one of those reads `loss_mask`). `behavior_logp` carries the worker's log-prob
of each completion token at the position that predicts it (target-aligned, see
`train_step.make_batch`). Advantages come from `learner_jax/training/advantages.py` on each
group's rewards, rows sample-major within a group.

A MoE policy's trajectories carry the experts the worker's engine routed each forwarded
token to (bridge/contracts/routing.py); the batch's `routing` [B, T, L, k] holds them at the
input positions they were recorded for, 0 .. P + C - 2, the positions whose targets are
real. The other positions (the last token, padding) predict nothing that trains; they get
experts 0..k-1, a valid routing whose outputs no loss reads.

`on_policy` marks rows every token of which was sampled by `current_version` (the
learner's params when the step starts): the train step's `mismatch/kl` is measured on
exactly those, where behavior and learner log-probs should agree up to numerics.

A batch is built only from complete, validated groups (the controller checked token ids,
lengths and counts on submission); rows that do not fit the configured shape are refused
with a clear error rather than cut, since a cut completion would change its reward's
meaning.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from bridge.contracts import routing as routing_contract
from bridge.control.protocol import ConsumedGroup
from learner_jax.training import advantages as adv_lib
from learner_jax.training import diagnostics
from learner_jax.training.train_step import Batch, make_batch


def groups_to_batch(
    groups: Sequence[ConsumedGroup],
    group_size: int,
    max_prompt_len: int,
    max_answer_len: int,
    current_version: int,
    adv_cfg: adv_lib.AdvantageConfig,
    pad_id: int = 0,
    refused: frozenset[int] = frozenset(),
) -> tuple[Batch, dict]:
    """(numpy Batch, rollout stats) for G groups of `group_size` trajectories each. The
    rows of `refused` groups (the exact check's, learner_jax/rl/exact_check.py) stay in
    the batch, so its shape is fixed, with seq_mask 0: nothing of them trains."""
    rows = len(groups) * group_size
    width = max_prompt_len + max_answer_len + 1
    tokens = np.full((rows, width), pad_id, np.int32)
    loss_mask = np.zeros((rows, width), np.float32)
    valid = np.zeros((rows, width), bool)
    behavior = np.zeros((rows, width - 1), np.float32)
    on_policy = np.zeros((rows,), np.float32)
    rewards = np.zeros((len(groups), group_size), np.float32)
    versions, lengths, lags, think = [], [], [], []
    for gi, group in enumerate(groups):
        trajs = sorted(group.trajectories, key=lambda t: t.sample_index)
        if len(trajs) != group_size:
            raise ValueError(
                f"group {group.group_id} has {len(trajs)} trajectories, expected {group_size}"
            )
        for si, t in enumerate(trajs):
            r = gi * group_size + si
            p, c = list(t.prompt_token_ids), list(t.completion_token_ids)
            if len(p) > max_prompt_len or len(c) > max_answer_len:
                raise ValueError(
                    f"group {group.group_id} sample {si}: prompt {len(p)} / completion "
                    f"{len(c)} tokens exceed max_prompt_len {max_prompt_len} / "
                    f"max_answer_len {max_answer_len}"
                )
            if len(t.logprobs) != len(c):
                raise ValueError(f"group {group.group_id}: {len(t.logprobs)} logprobs for {len(c)}")
            n = len(p) + len(c)
            tokens[r, :n] = p + c
            valid[r, :n] = True
            loss_mask[r, len(p) : n] = t.mask  # 0 on environment tokens (multi-turn)
            # logprobs[j] scores completion token j, the target of position len(p) + j - 1.
            behavior[r, len(p) - 1 : n - 1] = t.logprobs
            on_policy[r] = float(all(v == current_version for v in t.versions))
            rewards[gi, si] = t.reward
            versions.extend(t.versions)
            lags.append(current_version - min(t.versions))
            lengths.append(len(c))
            think.append(t.think_tokens)
    adv, seq_mask = adv_lib.compute_advantages(rewards, adv_cfg)
    keep = np.repeat([g.group_id not in refused for g in groups], group_size)
    seq_mask = np.asarray(seq_mask) * keep
    batch = make_batch(
        tokens,
        loss_mask,
        valid,
        behavior_logp=behavior,
        advantages=np.asarray(adv),
        seq_mask=np.asarray(seq_mask),
        on_policy=on_policy,
    )
    recorded = routing_rows(groups, group_size, width - 1)
    if recorded is not None:
        batch = dataclasses.replace(batch, routing=recorded)
    stats = {
        "reward/mean": float(rewards.mean()),
        "reward/max": float(rewards.max()),
        "reward/solved_groups": float((rewards.max(axis=1) >= 1.0).mean()),
        # Samples with the full reward: answer correctness for verifier tasks whose partial
        # credit (arithmetic's format bonus) stays below 1, which reward/mean mixes in.
        "reward/correct": float((rewards >= 1.0).mean()),
        "rollout/on_policy_frac": float(on_policy.mean()),
        "rollout/version_mean": float(np.mean(versions)),
        "rollout/completion_len": float(np.mean(lengths)),
        # completion tokens inside <think>...</think> (reasoning models; 0 without thinking)
        "rollout/think_len": float(np.mean(think)),
        **diagnostics.group_stats(rewards, adv),
    }
    # Per-trajectory staleness counts, summed over steps into the report's histogram.
    for lag, count in zip(*np.unique(lags, return_counts=True), strict=True):
        stats[f"staleness/lag_{int(lag)}"] = float(count)
    return batch, stats


def routing_rows(groups: Sequence[ConsumedGroup], group_size: int, length: int):
    """int32 [rows, length, L, k]: each trajectory's recorded routing at its input positions
    (module docstring), or None when no trajectory carries any. All or none: a batch with
    some rows unrecorded cannot be replayed."""
    trajs = [t for g in groups for t in sorted(g.trajectories, key=lambda t: t.sample_index)]
    have = [t.routed_experts is not None for t in trajs]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(f"{have.count(False)} of {len(trajs)} trajectories carry no routing")
    first = trajs[0].routed_experts
    out = np.broadcast_to(
        np.arange(first.k, dtype=np.int32), (len(trajs), length, first.num_layers, first.k)
    ).copy()
    for r, t in enumerate(trajs):
        rec = t.routed_experts
        ids = routing_contract.decode(rec.num_layers, rec.k, rec.ids)
        want = routing_contract.num_rows(len(t.prompt_token_ids), len(t.completion_token_ids))
        if ids.shape[0] != want or ids.shape[1:] != out.shape[2:]:
            raise ValueError(f"row {r}: routing {ids.shape}, expected ({want}, *{out.shape[2:]})")
        out[r, :want] = ids
    return out
