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
stay trained on. The sums and the quarantine live in the controller's database (`audit`
and `quarantine` tables), so a controller restart keeps both. A quarantine also bars who
registered the worker (bridge/control/trust/identity.py): its per-worker credential, or the
remote host that presented the shared secret, registers no more; only the operator's own
loopback workers are never barred.

Sampling check (issue 23 item 6, bridge/contracts/sampling_check.py). A worker can report
the policy's TRUE log-probs of tokens it chose itself (greedy, best of n, the reference
answer): k3 is then ~0. The same rows also give, per token, log p(token) + H(p) and
Var_p[log p] under the learner's processed distribution (temperature, top-k/top-p/min-p);
the controller keeps per-worker decayed sums (deviations weighted w, variances w^2, so
Z = dev / sqrt(var) stays ~N(0, 1) for a sampler) and quarantines at |Z| >
`sampling_z` (`audit_sampling_z`, 6) past `min_tokens`. Z > 0: likelier tokens than
sampling gives (greedy, best-of-n); Z < 0: tokens the policy would rarely say (forced
text). The likely-token side also has a test valid at any token count, so a picker with
short answers is judged within a few groups, not 64: a CUSUM of per-token e-values, past
`sampling_evidence` (`audit_sampling_evidence`, 23 = ln 1e10; sampling_check.py).
tests/learner_jax/rl/sampling_audit_test.py runs it end to end.

MoE routing (bridge/contracts/routing.py). A MoE worker records the experts its engine
routed each token to, and the learner may replay them (`model.moe.routing_replay`), so a
forged record would steer which experts train. The train step compares each on-policy
row's recorded experts with the learner's own top-k at the same positions; per identity
the controller adds up the (token, layer) rows checked and their agreement, and past
`routing_min_rows` a disagreement above `routing_threshold` quarantines (an honest bf16
engine differs only where its rounding flips a near-tie between experts; the number and
its measurement are in routing.py).

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

from bridge.contracts import exact_check, routing, sampling_check
from bridge.contracts.k3 import k3
from bridge.control.trust.identity import LOCAL, IdentityBook


@dataclasses.dataclass(frozen=True)
class AuditStat:
    """One worker's audited tokens from one learner step (or one group)."""

    worker_id: str
    version: int
    tokens: int
    sum_k3: float  # sum over tokens of k3(learner - behaviour)
    sum_logratio: float  # sum over tokens of behaviour - learner log-prob
    # The sampling check (bridge/contracts/sampling_check.py): sum over the same tokens of
    # log p(token) + H(p) and of Var_p[log p], p the learner's processed distribution.
    sum_dev: float = 0.0
    sum_var: float = 0.0
    # Its evidence test: sum of log p(token) - log sum p^2 (the log of an e-value).
    sum_evidence: float = 0.0
    # The exact check (learner_jax/rl/exact_check.py): tokens checked against the lease's
    # seed, and how many of them were not the seeded sampler's choice.
    exact_tokens: int = 0
    exact_mismatches: int = 0
    exact_flips: int = 0  # within the margin but not the exact argmax (exact_check.py)
    # MoE routing (bridge/contracts/routing.py): (token, layer) rows whose recorded experts
    # the learner checked against its own top-k, and the sum of their agreement (the
    # fraction of the k recorded experts that are among the learner's own).
    routing_rows: float = 0.0
    routing_agree: float = 0.0


@dataclasses.dataclass(frozen=True)
class AuditConfig:
    kl_threshold: float = 0.01
    logratio_threshold: float = 0.1
    min_tokens: int = 256
    window_tokens: int = 4096
    sampling_z: float = sampling_check.Z_MAX  # |Z| past this: tokens not sampled; 0 = off
    # CUSUM of the e-values past this: tokens likelier than sampled, at any token count
    sampling_evidence: float = sampling_check.EVIDENCE_MAX  # 0 = off
    # Tokens not chosen by the seeded sampler, per identity, before quarantine; 0 = off
    exact_quarantine_tokens: int = exact_check.QUARANTINE_TOKENS
    exact_quarantine_fraction: float = exact_check.QUARANTINE_FRACTION
    exact_flip_tokens: int = exact_check.FLIP_TOKENS
    exact_flip_fraction: float = exact_check.FLIP_FRACTION
    # Recorded MoE routing disagreeing with the learner's own past this fraction of rows,
    # after routing_min_rows checked rows: quarantine (bridge/contracts/routing.py); 0 = off
    routing_threshold: float = routing.DISAGREE_THRESHOLD
    routing_min_rows: int = routing.MIN_ROWS


def rows_to_worker_stats(
    worker_ids, versions, behaviour_logp, learner_logp, mask, current_version: int
) -> list[AuditStat]:
    """Per-worker `AuditStat`s of a batch's rows sampled at `current_version`.

    worker_ids [B] (str), versions [B] (the row's policy version; pass -1 for a row with
    mixed versions), behaviour_logp / learner_logp / mask [B, T] aligned the same way (the
    learner's target-aligned arrays: `Batch.behavior_logp`, its own log p(targets) and
    `Batch.loss_mask`). Rows of padding or of groups without a worker id are skipped."""
    f64 = lambda x: np.asarray(x, np.float64)
    row_k3, row_lr, row_n = row_sums(f64(learner_logp), f64(behaviour_logp), f64(mask))
    on = np.asarray(versions) == current_version
    return row_sums_to_worker_stats(worker_ids, on, row_k3, row_lr, row_n, current_version)


def row_sums(learner_logp, behaviour_logp, mask, xp=np):
    """Per-row audit sums of [B, T] target-aligned log-probs over the tokens where
    `mask` > 0: (sum of k3(learner - behaviour), sum of the log-ratio behaviour - learner,
    token count), each [B]. The one definition of what the audit adds up: the jitted train
    step calls it with `xp=jax.numpy` (its dtype), the re-score and `rows_to_worker_stats`
    with numpy in float64. Positions outside the mask count 0, whatever they hold."""
    d = xp.where(mask > 0, learner_logp - behaviour_logp, 0.0)  # [B, T]
    return (k3(d, xp=xp) * mask).sum(axis=1), (-d * mask).sum(axis=1), mask.sum(axis=1)


def row_sums_to_worker_stats(
    worker_ids, on_policy, row_k3, row_logratio, row_tokens, version: int,
    row_dev=None, row_var=None, row_evidence=None, row_routing_agree=None,
    row_routing_rows=None,
) -> list[AuditStat]:  # fmt: skip
    """The same from per-row sums (what a jitted step can return instead of [B, T]);
    `row_dev` / `row_var` / `row_evidence`: the sampling check's per-row sums
    (`sampling_check.row_sums`, `row_evidence`), none = not measured (zeros);
    `row_routing_agree` / `row_routing_rows`: a MoE step's routing check per row (the
    agreement summed over the row's (token, layer) pairs, and their count)."""
    zeros = [0.0] * len(worker_ids)
    if row_dev is None or row_var is None:
        row_dev = row_var = zeros
    row_evidence = zeros if row_evidence is None else row_evidence
    if row_routing_agree is None or row_routing_rows is None:
        row_routing_agree = row_routing_rows = zeros
    acc: dict[str, list[float]] = {}
    rows = zip(worker_ids, on_policy, row_k3, row_logratio, row_tokens, row_dev, row_var,
               row_evidence, row_routing_agree, row_routing_rows, strict=True)  # fmt: skip
    for w, on, *sums in rows:  # k3, log-ratio, tokens, dev, var, evidence, agree, moe rows
        if not w or not on or sums[2] <= 0:
            continue
        s = acc.setdefault(str(w), [0.0] * 8)
        for i, x in enumerate(sums):
            s[i] += float(x)
    return [
        AuditStat(worker_id=w, version=int(version), tokens=int(n), sum_k3=a, sum_logratio=b,
                  sum_dev=d, sum_var=v, sum_evidence=e, routing_agree=g, routing_rows=m)
        for w, (a, b, n, d, v, e, g, m) in sorted(acc.items())
    ]  # fmt: skip


def row_workers(groups, group_size: int) -> list[str]:
    """worker id of each row of `rollout_batch.groups_to_batch(groups, group_size, ...)`."""
    return [g.worker_id for g in groups for _ in range(group_size)]


class WorkerAudit:
    """Token-decayed sums per identity (`evidence_key`), kept in the controller's database
    (`audit` table, so a restart keeps the evidence); `add` says why a worker is now past a
    threshold. The caller holds the database's transaction."""

    def __init__(self, config: AuditConfig, db):
        self.config, self.db = config, db

    @classmethod
    def from_config(cls, c, db) -> WorkerAudit:
        """From the controller's config (its audit_* keys)."""
        thresholds = (c.audit_kl_threshold, c.audit_logratio_threshold)
        window = (c.audit_min_tokens, c.audit_window_tokens)
        sampling = (c.audit_sampling_z, c.audit_sampling_evidence)
        exact = (c.exact_quarantine_tokens, c.exact_quarantine_fraction, c.exact_flip_tokens,
                 c.exact_flip_fraction)  # fmt: skip
        moe = (c.audit_routing_threshold, c.audit_routing_min_rows)
        return cls(AuditConfig(*thresholds, *window, *sampling, *exact, *moe), db)

    def add_routing(self, stat: AuditStat) -> str | None:
        """Fold in the routing check's sums; why the worker must be quarantined, else None.
        Like the exact check's counts, they add up per identity (`evidence_key`)."""
        c = self.config
        if stat.routing_rows <= 0 or c.routing_threshold <= 0:
            return None
        if not (math.isfinite(stat.routing_agree) and math.isfinite(stat.routing_rows)):
            return "non-finite routing audit numbers"
        party = evidence_key(self.db, stat.worker_id)
        rows = self.db.get(f"routing_rows/{party}", 0.0) + float(stat.routing_rows)
        agree = self.db.get(f"routing_agree/{party}", 0.0) + float(stat.routing_agree)
        self.db.put(f"routing_rows/{party}", rows)
        self.db.put(f"routing_agree/{party}", agree)
        self.db.incr("audit/routing_rows", float(stat.routing_rows))
        disagree = 1.0 - agree / rows
        if rows >= c.routing_min_rows and disagree > c.routing_threshold:
            return (
                f"recorded MoE routing far from the learner's own: {disagree:.2%} of "
                f"{rows:.0f} (token, layer) experts differ (threshold {c.routing_threshold:.2%}; "
                "an honest engine's differ only where its numerics flip near-ties)"
            )
        return None

    def add_exact(self, stat: AuditStat) -> str | None:
        """Fold in the exact check's counts; why the worker must be quarantined, else None.
        Mismatches add up per identity (`evidence_key`), like the statistical sums."""
        if stat.exact_tokens <= 0:
            return None
        self.db.incr("audit/exact_tokens", stat.exact_tokens)
        party = evidence_key(self.db, stat.worker_id)
        checked = self.db.get(f"exact_checked/{party}", 0) + int(stat.exact_tokens)
        self.db.put(f"exact_checked/{party}", checked)
        c, why = self.config, None
        for kind, n, limit, fraction, what in (
            ("bad", stat.exact_mismatches, c.exact_quarantine_tokens,
             c.exact_quarantine_fraction, "were not the seeded sampler's choice"),
            ("flips", stat.exact_flips, c.exact_flip_tokens, c.exact_flip_fraction,
             "were near-tie runner-ups of the seeded sampler's choice"),
        ):  # fmt: skip
            if n <= 0:
                continue
            self.db.incr(f"audit/exact_{kind}", n)
            count = self.db.get(f"exact_{kind}/{party}", 0) + int(n)
            self.db.put(f"exact_{kind}/{party}", count)
            if why is None and exact_check.quarantines(count, checked, limit, fraction):
                why = (
                    f"{count} of {checked} checked tokens {what} (thresholds {limit} tokens "
                    f"and {fraction:.2%}; the learner recomputed each under its lease's seed)"
                )
        return why

    def add(self, stat: AuditStat) -> str | None:
        """Fold in one stat; returns why the worker must be quarantined, else None."""
        c = self.config
        numbers = (stat.sum_k3, stat.sum_logratio, stat.sum_dev, stat.sum_var, stat.sum_evidence)
        if stat.tokens <= 0 or not all(math.isfinite(x) for x in numbers):
            return None if stat.tokens <= 0 else "non-finite audit numbers"
        party = evidence_key(self.db, stat.worker_id)
        s = self.db.audit_sums(party) or dict(
            k3=0.0, lr=0.0, n=0.0, total=0.0, dev=0.0, var=0.0, cusum=0.0
        )
        keep = math.exp(-stat.tokens / c.window_tokens)
        s["k3"] = keep * s["k3"] + stat.sum_k3
        s["lr"] = keep * s["lr"] + stat.sum_logratio
        s["n"] = keep * s["n"] + stat.tokens
        s["total"] += stat.tokens
        # Weights w on the deviations, w^2 on their variances: Z stays ~N(0, 1) for an
        # honest sampler (a weighted martingale sum), and only the recent window counts.
        s["dev"] = keep * s["dev"] + stat.sum_dev
        s["var"] = keep * keep * s["var"] + stat.sum_var
        # The evidence test's CUSUM (sampling_check.py): valid at any token count, so it
        # judges before min_tokens (a one-token-answer picker would otherwise last 64
        # groups); the reset at 0 keeps an honest past from hiding a later change.
        s["cusum"] = max(0.0, s["cusum"] + stat.sum_evidence)
        self.db.put_audit_sums(party, s)
        kl, lr = s["k3"] / s["n"], s["lr"] / s["n"]
        if c.sampling_evidence > 0 and s["cusum"] >= c.sampling_evidence:
            return (
                f"sampled tokens likelier than the policy samples: evidence "
                f"{s['cusum']:.1f} (threshold {c.sampling_evidence:g}, ln of the likelihood "
                f"ratio) after {s['total']:.0f} audited tokens"
            )
        if s["total"] < c.min_tokens:
            return None
        z = sampling_check.z_score(s["dev"], s["var"])
        if c.sampling_z > 0 and abs(z) > c.sampling_z:
            how = "likelier" if z > 0 else "less likely"
            return (
                f"sampled tokens {how} than the policy samples: Z {z:+.2f} (threshold "
                f"|Z| {c.sampling_z:g}) over the last ~{s['n']:.0f} of {s['total']:.0f} "
                "audited tokens"
            )
        if kl > c.kl_threshold or abs(lr) > c.logratio_threshold:
            return (
                f"behaviour log-probs far from the learner's: mean k3 {kl:.3g} per token "
                f"(threshold {c.kl_threshold:g}), mean log-ratio {lr:+.3g} (threshold "
                f"{c.logratio_threshold:g}) over the last ~{s['n']:.0f} of "
                f"{s['total']:.0f} audited tokens"
            )
        return None

    def fold(self, stats, now: float) -> list[str]:
        """`add` each stat and `quarantine` every worker now past a threshold (once);
        returns the workers quarantined now."""
        out: list[str] = []
        already = self.db.quarantined()
        for st in stats:
            why = self.add_exact(st) or self.add_routing(st) or self.add(st)
            w = st.worker_id
            if why and self.db.worker(w) is not None and w not in already and w not in out:
                quarantine(self.db, w, why, now)
                out.append(w)
        self.db.incr("audit/tokens", sum(st.tokens for st in stats))
        return out

    def score(self, worker_id: str) -> dict:
        """{'kl', 'logratio', 'sampling_z', 'sampling_evidence', 'tokens'} of a worker's
        identity (zeros before any audit)."""
        s = self.db.audit_sums(evidence_key(self.db, worker_id))
        if not s or s["n"] <= 0:
            return {"kl": 0.0, "logratio": 0.0, "sampling_z": 0.0, "sampling_evidence": 0.0,
                    "tokens": 0.0}  # fmt: skip
        return {
            "kl": s["k3"] / s["n"],
            "logratio": s["lr"] / s["n"],
            "sampling_z": sampling_check.z_score(s["dev"], s["var"]),
            "sampling_evidence": s["cusum"],
            "tokens": s["total"],
        }


def vouches(db, worker_id: str, min_tokens: int) -> bool:
    """Whether the audit vouches for `worker_id`'s work: only its own identity's audited
    tokens do (`evidence_key`), `min_tokens` of them passed. Until then its measured
    throughput does not count for activation (fleet_plan.py: it stays active, unmeasured),
    so a $0 worker returning junk fast cannot put an audited worker on standby, not even
    before the run's first audit (when nobody is vouched for, activation keeps everyone
    active)."""
    s = db.audit_sums(evidence_key(db, worker_id))
    return s is not None and s["total"] >= min_tokens


def evidence_key(db, worker_id: str) -> str:
    """Whose evidence a worker's audited tokens add to: its identity (the credential or the
    caller's host that registered it, identity.py), so registering again under a new id
    starts from the evidence the party already has; the operator's own loopback workers,
    never barred, are judged one id at a time."""
    party = IdentityBook(db).of(worker_id)
    return worker_id if party in (None, LOCAL) else party


def quarantine(db, worker_id: str, why: str, now: float) -> int:
    """Revoke `worker_id`'s token, end its leases, requeue its buffered groups (in the
    caller's transaction); returns how many buffered groups were dropped."""
    for lease_id in db.active_leases(worker_id):
        db.end_lease(lease_id, "released")
    dropped = db.buffered_of_worker(worker_id)
    db.requeue(dropped)
    db.quarantine_worker(worker_id, now, why, len(dropped))  # token revoked, persisted
    db.incr("fleet/quarantined")
    db.incr("audit/dropped_groups", len(dropped))
    logging.warning(
        "quarantined worker %s: %s; token revoked, %d buffered groups dropped",
        worker_id,
        why,
        len(dropped),
    )
    return len(dropped)
