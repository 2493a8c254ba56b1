"""Did the policy pick these tokens? A likelihood test of a worker's sampled tokens against
the learner's distribution (issue 23 item 6). The train step (train_step.py, rows its own
version sampled) and the audit's re-score (learner_jax/rl/rescore.py, older versions) add
up per row what `row_sums` says; the controller's audit (bridge/control/trust/audit.py) keeps the
per-worker sums and quarantines past |Z| > `audit_sampling_z`.

The log-prob audit (bridge/control/trust/audit.py) catches a worker whose reported log-probs
are not the policy's; it cannot catch one that reports the policy's TRUE log-probs of
tokens it chose itself (greedy, the best of many samples, a reference answer). Sampling
leaves a fingerprint the learner can check without knowing the worker's random numbers:
at a model position t with distribution p_t (the learner's, after the same temperature and
truncation the worker sampled under), an honestly sampled token x_t has

    s_t = log p_t(x_t),   E[s_t] = -H(p_t),   Var[s_t] = E_p[(log p)^2] - H(p_t)^2 = V_t.

Z = sum_t (s_t + H_t) / sqrt(sum_t V_t) over a worker's audited tokens is a martingale sum
(each term has mean 0 given the prefix), so it is close to N(0, 1) once the variance is
spread over many tokens. Choosing tokens moves it: greedy and best-of-n pick likelier
tokens than sampling (Z >> 0); forcing text the policy would not say picks unlikelier ones
(Z << 0). The test is two-sided, |Z| > `z_max`. Positions where p is (nearly) one-hot add
nothing (V_t = 0): a worker cannot be judged on tokens the policy is certain of, and it
gains nothing there either.

Z needs `audit_min_tokens` before it may judge: with few tokens one rare honest token can
push it anywhere (its tails are as heavy as the policy's). A worker with short answers (a
greedy picker answering one token: 4 tokens a group) then lasts 64 groups. So a second
test, valid at ANY sample size, watches the likely-token direction: per token

    e_t = log p_t(x_t) - log sum_i p_t(i)^2,   E_p[exp(e_t)] = sum_i p_i p_i / sum p^2 = 1,

a likelihood ratio (of the tilted distribution p^2 / sum p^2 against p), so for an honest
sampler exp(sum e_t) is a test martingale. The controller keeps a CUSUM of it per worker,
C = max(0, C + sum of the stat's e_t), and quarantines at C >= `audit_sampling_evidence`
(h = 23 = ln 1e10): by Lorden's bound an honest sampler's expected number of stats before
a false alarm is at least e^h = 1e10, whatever the token count, and the reset at 0 keeps
a worker that was honest for a while from banking credit. A greedy token adds
log(p_max / sum p^2) >= 0 each (best-of-n: likelier tokens, in expectation > 0); an honest
one subtracts H(p) - H_2(p) >= 0 on average (H_2 the collision entropy). An engine whose
numerics differ by a KL of ~1e-6 per token (bf16) changes E[exp(e_t)] by ~1e-6: harmless.

`xp` is the array module: numpy here, jax.numpy if a jitted step computes the moments.
"""

from __future__ import annotations

import math

import numpy as np

Z_MAX = 6.0  # two-sided; N(0,1) beyond 6 sigma: ~2e-9 per look
EVIDENCE_MAX = 23.0  # ln 1e10: an honest sampler's mean stats to a false alarm >= 1e10


def position_moments(logp, xp=np):
    """(H, V) per position of full log-prob rows `logp` [..., vocab] (log-softmax of the
    processed logits): the entropy and the variance of log p under p."""
    p = xp.exp(logp)
    finite = xp.where(p > 0, logp, 0.0)  # dropped tokens (-inf) add nothing, and no NaN
    entropy = -(p * finite).sum(axis=-1)
    second = (p * finite * finite).sum(axis=-1)
    return entropy, xp.maximum(second - entropy * entropy, 0.0)


def row_sums(sampled_logp, entropy, variance, mask, xp=np):
    """Per-row (sum of s + H, sum of V, token count) over the positions where `mask` > 0;
    [B, T] inputs, [B] outputs (what a worker's evidence accumulates)."""
    on = mask > 0
    dev = xp.where(on, sampled_logp + entropy, 0.0).sum(axis=-1)
    var = xp.where(on, variance, 0.0).sum(axis=-1)
    return dev, var, on.sum(axis=-1)


def z_score(sum_dev: float, sum_var: float) -> float:
    """Z of accumulated sums; 0.0 while there is no variance to judge by."""
    return sum_dev / math.sqrt(sum_var) if sum_var > 0 else 0.0


def log_collision(logp, xp=np):
    """log sum_i p_i^2 per position of full log-prob rows `logp` [..., vocab] (dropped
    tokens -inf: they add 0)."""
    m = logp.max(axis=-1, keepdims=True)
    return 2.0 * m[..., 0] + xp.log(xp.exp(2.0 * (logp - m)).sum(axis=-1))


def row_evidence(sampled_logp, collision, mask, xp=np):
    """Per-row sum over the positions where `mask` > 0 of log p(x) - log sum p^2 [B]: the
    log of the e-value the controller's CUSUM adds up."""
    return xp.where(mask > 0, sampled_logp - collision, 0.0).sum(axis=-1)
