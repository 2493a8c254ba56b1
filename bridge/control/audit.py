"""Behaviour log-prob audit: per-worker distance between a worker's log-probs and the
learner's for the same tokens and version, and quarantine past configured thresholds.

    # learner side, after each RL step (numpy only; rows are the batch's trajectories):
    stats = audit.rows_to_worker_stats(worker_ids, versions, behaviour_logp, learner_logp,
                                       loss_mask, current_version)
    quarantined = ctl.audit(stats)          # Controller.audit -> WorkerAudit + quarantine

The train step compares the rows sampled by the learner's current version (its log-probs
are of its current parameters); rows tagged with an older version are re-scored, sampled,
under that version read back from the weight store (learner_jax/rl/rescore.py, every
`controller.audit_rescore_every` RL steps), so tagging tokens with an old version does not
dodge the audit.

Score. Per token, d = learner - behaviour log-prob; k3(d) = exp(d) - 1 - d estimates
KL(behaviour || learner) (bridge/contracts/k3.py, the learner's `mismatch/kl`). Per worker
the controller keeps token-decayed sums (each new token discounts the past by
exp(-1 / window_tokens)) of k3, of the log-ratio behaviour - learner and of tokens, so the
score is a recent per-token mean. Once a worker has `min_tokens` audited tokens, a mean k3
above `kl_threshold` or a mean |log-ratio| above `logratio_threshold` quarantines it: its
token is revoked (every call answers 401), its leases end and its buffered, not yet
consumed groups are requeued (counted in `audit/dropped_groups`), `fleet/quarantined`
counts it and a warning names the worker and the numbers. Groups it already trained on
stay trained on. A worker holding the join secret can register again under a new id; it
then starts from zero evidence and is caught again after `min_tokens`.

Defaults, measured (tests/rollout_gpu/audit_test.py; BUILD_NOTES.md): against the fp32
learner an honest vLLM engine on the tiny model scores a mean k3 of 2e-14 per token in fp32
and 7e-7 in bf16 (worst group 8.5e-7, mean log-ratio 9e-6); bf16 inference engines on real
models are reported at the 1e-3 order. The default `kl_threshold` 0.01 is 10x above that
and 1e4x above the tiny bf16 engine; `logratio_threshold` 0.1 likewise. Fabricated
log-probs (all -0.01) score 3.8, a second random tiny model 0.026 (mean log-ratio -0.035).
Raise the thresholds for engines known to drift more (fp8, some MoE kernels).
"""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np

from bridge.contracts.k3 import k3


@dataclasses.dataclass(frozen=True)
class AuditStat:
    """One worker's audited tokens from one learner step (or one group)."""

    worker_id: str
    version: int
    tokens: int
    sum_k3: float  # sum over tokens of k3(learner - behaviour)
    sum_logratio: float  # sum over tokens of behaviour - learner log-prob


@dataclasses.dataclass(frozen=True)
class AuditConfig:
    kl_threshold: float = 0.01
    logratio_threshold: float = 0.1
    min_tokens: int = 256
    window_tokens: int = 4096


def rows_to_worker_stats(
    worker_ids, versions, behaviour_logp, learner_logp, mask, current_version: int
) -> list[AuditStat]:
    """Per-worker `AuditStat`s of a batch's rows sampled at `current_version`.

    worker_ids [B] (str), versions [B] (the row's policy version; pass -1 for a row with
    mixed versions), behaviour_logp / learner_logp / mask [B, T] aligned the same way (the
    learner's target-aligned arrays: `Batch.behavior_logp`, its own log p(targets) and
    `Batch.loss_mask`). Rows of padding or of groups without a worker id are skipped."""
    versions = np.asarray(versions)
    mask = np.asarray(mask, np.float64)
    d = np.asarray(learner_logp, np.float64) - np.asarray(behaviour_logp, np.float64)
    d = np.where(mask > 0, d, 0.0)  # [B, T]
    row_k3 = (k3(d) * mask).sum(axis=1)
    row_lr = (-d * mask).sum(axis=1)
    row_n = mask.sum(axis=1)
    on = versions == current_version
    return row_sums_to_worker_stats(worker_ids, on, row_k3, row_lr, row_n, current_version)


def row_sums_to_worker_stats(
    worker_ids, on_policy, row_k3, row_logratio, row_tokens, version: int
) -> list[AuditStat]:
    """The same from per-row sums (what a jitted step can return instead of [B, T])."""
    acc: dict[str, list[float]] = {}
    for w, on, a, b, n in zip(worker_ids, on_policy, row_k3, row_logratio, row_tokens, strict=True):
        if not w or not on or n <= 0:
            continue
        s = acc.setdefault(str(w), [0.0, 0.0, 0.0])
        s[0] += float(a)
        s[1] += float(b)
        s[2] += float(n)
    return [
        AuditStat(worker_id=w, version=int(version), tokens=int(n), sum_k3=a, sum_logratio=b)
        for w, (a, b, n) in sorted(acc.items())
    ]


def row_workers(groups, group_size: int) -> list[str]:
    """worker id of each row of `rollout_batch.groups_to_batch(groups, group_size, ...)`."""
    return [g.worker_id for g in groups for _ in range(group_size)]


class WorkerAudit:
    """Token-decayed per-worker sums; `add` returns the workers now past a threshold."""

    def __init__(self, config: AuditConfig):
        self.config = config
        self._s: dict[str, dict[str, float]] = {}

    def add(self, stat: AuditStat) -> str | None:
        """Fold in one stat; returns why the worker must be quarantined, else None."""
        c = self.config
        if stat.tokens <= 0 or not (
            math.isfinite(stat.sum_k3) and math.isfinite(stat.sum_logratio)
        ):
            return None if stat.tokens <= 0 else "non-finite audit numbers"
        s = self._s.setdefault(stat.worker_id, dict(k3=0.0, lr=0.0, n=0.0, total=0.0))
        keep = math.exp(-stat.tokens / c.window_tokens)
        s["k3"] = keep * s["k3"] + stat.sum_k3
        s["lr"] = keep * s["lr"] + stat.sum_logratio
        s["n"] = keep * s["n"] + stat.tokens
        s["total"] += stat.tokens
        kl, lr = s["k3"] / s["n"], s["lr"] / s["n"]
        if s["total"] < c.min_tokens:
            return None
        if kl > c.kl_threshold or abs(lr) > c.logratio_threshold:
            return (
                f"behaviour log-probs far from the learner's: mean k3 {kl:.3g} per token "
                f"(threshold {c.kl_threshold:g}), mean log-ratio {lr:+.3g} (threshold "
                f"{c.logratio_threshold:g}) over the last ~{s['n']:.0f} of "
                f"{s['total']:.0f} audited tokens"
            )
        return None

    def score(self, worker_id: str) -> dict:
        """{'kl', 'logratio', 'tokens'} of a worker (zeros before any audit)."""
        s = self._s.get(worker_id)
        if not s or s["n"] <= 0:
            return {"kl": 0.0, "logratio": 0.0, "tokens": 0.0}
        return {"kl": s["k3"] / s["n"], "logratio": s["lr"] / s["n"], "tokens": s["total"]}


def quarantine(db, worker_id: str, why: str, now: float) -> int:
    """Revoke `worker_id`'s token, end its leases, requeue its buffered groups (in the
    caller's transaction); returns how many buffered groups were dropped."""
    for lease_id in db.active_leases(worker_id):
        db.end_lease(lease_id, "released")
    dropped = db.buffered_of_worker(worker_id)
    db.requeue(dropped)
    # A revoked token hashes to nothing: authenticate fails (401) from now on.
    db.update_worker(worker_id, token_hash=f"quarantined:{worker_id}", enabled=0, left_at=now)
    record = db.get("quarantine", {})
    record[worker_id] = {"at": now, "why": why, "dropped_groups": len(dropped)}
    db.put("quarantine", record)
    db.incr("fleet/quarantined")
    db.incr("audit/dropped_groups", len(dropped))
    logging.warning(
        "quarantined worker %s: %s; token revoked, %d buffered groups dropped",
        worker_id,
        why,
        len(dropped),
    )
    return len(dropped)
