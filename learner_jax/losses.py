"""Policy-gradient losses for the learner (registry by name), with off-policy correction.

Every loss has one signature, `loss_fn(logp [B, T], batch: LossInputs, cfg: LossConfig)
-> (scalar loss, metrics)`, and is a pure jnp function of `logp`, the learner's per-token
log-probs of the sampled completion tokens (the only input that carries gradient).

Notation, per token t of sequence b (only tokens with m_bt = 1 count, where m is
loss_mask times the optional per-sequence seq_mask; a sequence with no such token is
dropped from every mean):
    r_bt   = exp(logp_bt - prox_bt)            ratio to the proximal policy
    w_bt   = sg(exp(prox_bt - behav_bt))       behavior correction (sg = stop-gradient)
    c(x)   = clip(x, 1 - eps, 1 + eps_high)    (eps_high = eps unless set)
    pg_bt  = -W_bt * min(r_bt A_b, c(r_bt) A_b)
    k3_bt  = exp(ref_bt - logp_bt) - (ref_bt - logp_bt) - 1      (Schulman's k3)
    L_bt   = pg_bt + beta * k3_bt                                 (beta = kl_coef, 0 = off)
             (k3_bt times r_bt, gspo: s_b, with kl_bias_correction; see below)
    n_b    = sum_t m_bt,   K = #sequences with n_b > 0
W is the off-policy weight (no gradient), chosen by `off_policy` (c = is_cap, w as above,
rho_b = prod_t w_bt over the sequence's counted tokens, g_b = rho_b ** (1 / n_b)):
    'none'       W = 1                                plain PPO against prox
    'tis'        W = min(w, c)                        truncated IS, per token (IMPALA's
                                                      truncation, Espeholt et al. 2018;
                                                      "TIS", Yao et al. 2025)
    'mask'       W = w * 1[w <= c]                    one-sided token mask
    'token_mis'  W = w * 1[1/c <= w <= c]             two-sided masked IS per token: tokens
                                                      whose ratio leaves [1/c, c] are
                                                      dropped, not clipped (IcePop, Ling
                                                      Team 2025; token-level MIS, Liu, Yao
                                                      et al. 2025, "When speed kills
                                                      stability")
    'seq_mis'    W_bt = rho_b * 1[1/c <= rho_b <= c]  two-sided masked IS per sequence: the
                                                      whole sequence is dropped when its
                                                      likelihood ratio leaves [1/c, c]
                                                      (sequence-level MIS, same paper)
    'geo_seq'    W_bt = min(g_b, c)                   geometric-mean sequence ratio,
                                                      truncated (GSPO's length-normalized
                                                      ratio, Zheng et al. 2025, used as the
                                                      behavior weight)
`off_policy` unset (None) keeps the older key `is_mode`: 'truncate' = 'tis', 'mask',
'none'. The sequence modes count a sequence once in the is_weight/* metrics.

Aggregations:
    grpo     loss = 1/K sum_b 1/n_b sum_t L_bt        (sequence mean, then batch mean)
    dr_grpo  loss = 1/K sum_b 1/C   sum_t L_bt        (C = dr_grpo_constant, default T)
    dapo     loss = sum_bt L_bt / sum_bt m_bt          (token mean over the whole batch;
                                                       use eps_high > eps: clip-higher)
    gspo     s_b  = exp(1/n_b sum_t (logp_bt - prox_bt))          (sequence-level ratio)
             W_b  = off_policy applied to g_b per sequence ('seq_mis' masks rho_b;
                    'geo_seq' is 'tis' here)
             loss = 1/K sum_b [-W_b min(s_b A_b, c(s_b) A_b) + beta/n_b sum_t k3_bt]

Off-policy correction is decoupled PPO (Hilton et al., 2021; AReaL, Fu et al., 2025): the
proximal policy is the learner's own parameters at the start of the update, so the trust
region is centred on where the learner is, not on the stale worker that sampled the
tokens; the gap between the two is corrected by the (truncated) importance weight w.
With prox == behavior and off_policy='none' every loss is its paper's on-policy form.

Entropy bonus (entropy_coef = alpha > 0, any loss): loss - alpha * 1/sum(m) sum_bt m_bt H_bt,
H_bt the full-vocabulary entropy of the learner's next-token distribution at the token
(with gradient), the classic exploration bonus of A3C (Mnih et al., 2016) and PPO
(Schulman et al., 2017). It keeps every decision's distribution from collapsing before
the rarely visited follow-up decisions are learned (BUILD_NOTES.md, issue 27: Kuhn).

Deliberate departures from the papers:
- GRPO/DAPO/Dr. GRPO clip the ratio to the worker's (old) policy; we clip r = pi/pi_prox
  and carry pi_prox/pi_behavior as a separate stop-gradient weight (decoupled PPO).
- The KL term is k3 of the learner's log-probs against the reference's, aggregated like
  the policy term of the same loss and, by default, weighted by nothing: neither the
  behavior correction W nor the ratio r. verl does the same (dp_actor.py
  `DataParallelPPOActor.update_policy`: core_algos.kl_penalty(log_prob, ref_log_prob,
  kl_loss_type) through agg_loss, times kl_loss_coef, outside the policy loss that takes
  the rollout IS weights); its `low_var_kl`/`k3` also clamps the log-ratio to [-20, 20]
  and k3 to [-10, 10], which bridge/contracts/k3.py does not. TRL's
  `GRPOTrainer._compute_loss` applies its vLLM IS ratio to the policy term only, then
  adds beta * k3; with GRPOConfig `use_bias_correction_kl=True` (default False) it first
  multiplies k3 by coef_1 = exp(logp - old_logp), with gradient (per sequence under
  importance_sampling_level='sequence'): DeepSeek-V3.2's unbiased KL estimator.
  `kl_bias_correction=True` is that form: k3_bt * r_bt (gspo: k3_bt * s_b). Our proximal
  policy is the learner at the step's start, so r = 1 in value and only the gradient
  changes: it gains k3 * grad log pi, the score term that makes the expected gradient (on
  tokens sampled from pi) that of KL(pi || ref); without it, that of KL(ref || pi).
- 'mask' mode zeroes a token's weight but keeps it in the normalizer, so the scale of the
  loss does not depend on how stale a batch is.
- GSPO's off-policy weight is the geometric mean of the token weights (length-normalized,
  like its ratio s_b), truncated or masked per sequence. GSPO uses much smaller clip
  ranges than token-level PPO (3e-4/4e-4 in the paper); set clip_eps accordingly.
- Sequences are dropped by seq_mask (DAPO's equal-reward filter, or batch padding) rather
  than by resampling, so shapes stay fixed under jit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from bridge.config.keys import SCHEMA
from bridge.contracts.k3 import k3

IS_MODES = ("truncate", "mask", "none")
OFF_POLICY = ("none", "tis", "mask", "token_mis", "seq_mis", "geo_seq")
_FROM_IS_MODE = {"truncate": "tis", "mask": "mask", "none": "none"}
_SEQUENCE_MODES = ("seq_mis", "geo_seq")  # one weight per sequence
_MASKING_MODES = ("mask", "token_mis", "seq_mis")  # the others truncate (or do nothing)
# exp() of a larger log-weight overflows fp32; only the (already capped) weight metrics
# see the clamp, never a gradient.
_MAX_LOG_W = 60.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LossInputs:
    prox_logp: jax.Array  # [B, T] learner's params at the start of the update
    behavior_logp: jax.Array  # [B, T] the worker's, sent with the trajectory
    advantages: jax.Array  # [B] per sequence
    loss_mask: jax.Array  # [B, T] 1 on completion tokens only
    ref_logp: jax.Array | None = None  # [B, T] frozen reference policy (KL)
    seq_mask: jax.Array | None = None  # [B] 0 drops a sequence (filtered group, padding)
    entropy: jax.Array | None = None  # [B, T] full-vocabulary entropy (entropy_coef > 0)
    kl_scale: jax.Array | None = None  # [] this step's factor on kl_coef (its schedule); None = 1


@dataclasses.dataclass(frozen=True)
@SCHEMA.declared_fields
class LossConfig:
    """`config.loss`: every `loss.*` key is a field (declared in bridge/config/keys.py)."""

    def __post_init__(self):
        if self.name not in _LOSSES:
            raise ValueError(f"unknown loss {self.name!r}; known: {sorted(_LOSSES)}")
        if self.is_mode not in IS_MODES:
            raise ValueError(f"is_mode must be one of {IS_MODES}, got {self.is_mode!r}")
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"clip_eps must be in (0, 1), got {self.clip_eps}")
        if self.off_policy is not None and self.off_policy not in OFF_POLICY:
            raise ValueError(f"off_policy must be one of {OFF_POLICY}, got {self.off_policy!r}")
        if self.off_policy is not None and self.is_mode != "truncate":
            raise ValueError(
                f"set off_policy or is_mode, not both (is_mode={self.is_mode!r}, "
                f"off_policy={self.off_policy!r})"
            )
        if self.clip_eps_high is not None and self.clip_eps_high <= 0:
            raise ValueError(f"clip_eps_high must be > 0, got {self.clip_eps_high}")
        if self.is_cap <= 0:
            raise ValueError(f"is_cap must be > 0, got {self.is_cap}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef}")
        if not 0.0 <= self.kl_end_fraction <= 1.0:
            raise ValueError(f"kl_end_fraction must be in [0, 1], got {self.kl_end_fraction}")
        if self.dr_grpo_constant is not None and self.dr_grpo_constant <= 0:
            raise ValueError(f"dr_grpo_constant must be > 0, got {self.dr_grpo_constant}")

    @property
    def correction(self) -> str:
        """The off-policy correction in effect (one of OFF_POLICY)."""
        return _FROM_IS_MODE[self.is_mode] if self.off_policy is None else self.off_policy

    @property
    def eps_high(self) -> float:
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high


LossFn = Callable[[jax.Array, LossInputs, LossConfig], tuple[jax.Array, dict[str, jax.Array]]]
_LOSSES: dict[str, LossFn] = {}


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    """Decorator: `@register_loss("grpo")` adds a loss to the registry."""

    def deco(fn: LossFn) -> LossFn:
        if name in _LOSSES:
            raise ValueError(f"loss {name!r} is already registered")
        _LOSSES[name] = fn
        return fn

    return deco


def get_loss(name: str) -> LossFn:
    if name not in _LOSSES:
        raise KeyError(f"unknown loss {name!r}; known: {sorted(_LOSSES)}")
    return _LOSSES[name]


def available_losses() -> list[str]:
    return sorted(_LOSSES)


def compute_loss(logp: jax.Array, batch: LossInputs, cfg: LossConfig):
    """The loss named by cfg.name, minus the entropy bonus when cfg.entropy_coef > 0."""
    loss, metrics = get_loss(cfg.name)(logp, batch, cfg)
    if cfg.entropy_coef > 0:
        if batch.entropy is None or batch.entropy.shape != logp.shape:
            raise ValueError("entropy_coef > 0 needs batch.entropy, shaped like logp")
        m, _, _ = _token_mask(batch)
        bonus = _masked_mean(batch.entropy, m)
        loss = loss - cfg.entropy_coef * bonus
        metrics = dict(metrics, loss=jax.lax.stop_gradient(loss))
    return loss, metrics


# ----------------------------------------------------------------------------- helpers


def _check(logp: jax.Array, batch: LossInputs, cfg: LossConfig) -> None:
    """Shape checks at trace time, so a bad batch fails loudly before any update."""
    if logp.ndim != 2:
        raise ValueError(f"logp must be [B, T], got {logp.shape}")
    b, _ = logp.shape
    for name in ("prox_logp", "behavior_logp", "loss_mask", "ref_logp"):
        x = getattr(batch, name)
        if x is not None and x.shape != logp.shape:
            raise ValueError(f"{name} has shape {x.shape}, logp has {logp.shape}")
    for name in ("advantages", "seq_mask"):
        x = getattr(batch, name)
        if x is not None and x.shape != (b,):
            raise ValueError(f"{name} must be [B]=({b},), got {x.shape}")
    if cfg.kl_coef > 0 and batch.ref_logp is None:
        raise ValueError("kl_coef > 0 needs batch.ref_logp")


def _token_mask(batch: LossInputs):
    """m [B, T], n_b [B], keep [B]: which tokens and sequences count."""
    m = batch.loss_mask.astype(jnp.float32)  # [B, T]
    if batch.seq_mask is not None:
        m = m * batch.seq_mask.astype(jnp.float32)[:, None]
    n = m.sum(axis=1)  # [B]
    keep = (n > 0).astype(jnp.float32)  # [B]
    return m, n, keep


def _masked_diff(a: jax.Array, b: jax.Array, m: jax.Array) -> jax.Array:
    # Padded positions may hold anything (even -inf); zero them before any exp().
    return jnp.where(m > 0, a - b, 0.0)


def _masked_mean(x: jax.Array, m: jax.Array) -> jax.Array:
    return (x * m).sum() / jnp.maximum(m.sum(), 1.0)


def _is_weight(log_w: jax.Array, valid: jax.Array, cfg: LossConfig, mode: str):
    """Off-policy weight W (no gradient) of `mode` applied entrywise to exp(log_w), and its
    statistics over the valid entries."""
    log_w = jax.lax.stop_gradient(log_w)
    raw = jnp.exp(jnp.minimum(log_w, _MAX_LOG_W))
    exceed = raw > cfg.is_cap
    if mode in ("token_mis", "seq_mis"):  # two-sided
        exceed = exceed | (raw < 1.0 / cfg.is_cap)
    exceed = exceed.astype(jnp.float32)
    if mode in ("tis", "geo_seq"):
        w = jnp.minimum(raw, cfg.is_cap)
    elif mode in _MASKING_MODES:
        w = raw * (1.0 - exceed)
    else:
        w = jnp.ones_like(raw)
    exceed_frac = _masked_mean(exceed, valid)
    zero = jnp.zeros((), jnp.float32)
    metrics = {
        "is_weight/mean": _masked_mean(raw, valid),
        "is_weight/max": jnp.max(jnp.where(valid > 0, raw, 0.0)),
        "is_weight/min": jnp.where(
            valid.sum() > 0, jnp.min(jnp.where(valid > 0, raw, jnp.inf)), 0.0
        ),
        "is_weight/applied_mean": _masked_mean(w, valid),
        "is_weight/clipped_frac": exceed_frac if mode in ("tis", "geo_seq") else zero,
        "is_weight/masked_frac": exceed_frac if mode in _MASKING_MODES else zero,
    }
    return w, metrics


def _token_weight(log_w: jax.Array, m: jax.Array, n: jax.Array, keep: jax.Array, cfg):
    """W [B, T] of the token-level losses from the per-token log weights log w [B, T]."""
    mode = cfg.correction
    if mode not in _SEQUENCE_MODES:
        return _is_weight(log_w, m, cfg, mode)
    log_seq = (log_w * m).sum(axis=1)  # log rho_b  [B]
    if mode == "geo_seq":
        log_seq = log_seq / jnp.maximum(n, 1.0)  # log g_b
    w, metrics = _is_weight(log_seq, keep, cfg, mode)
    return w[:, None], metrics


def _clipped_surrogate(ratio: jax.Array, adv: jax.Array, cfg: LossConfig):
    """-min(r A, c(r) A) and where the clipped branch is the active one."""
    unclipped = ratio * adv
    clipped = jnp.clip(ratio, 1.0 - cfg.clip_eps, 1.0 + cfg.eps_high) * adv
    return -jnp.minimum(unclipped, clipped), (clipped < unclipped).astype(jnp.float32)


def _beta(batch: LossInputs, cfg: LossConfig):
    """This step's KL weight: kl_coef times the schedule's factor when one is given."""
    return cfg.kl_coef if batch.kl_scale is None else cfg.kl_coef * batch.kl_scale


def _k3(logp: jax.Array, ref_logp: jax.Array, m: jax.Array) -> jax.Array:
    return k3(_masked_diff(ref_logp, logp, m), xp=jnp)  # [B, T]


def _token_level_loss(logp, batch: LossInputs, cfg: LossConfig, aggregate):
    """Shared body of the token-level losses; `aggregate(L [B,T], m, n, keep) -> scalar`."""
    _check(logp, batch, cfg)
    m, n, keep = _token_mask(batch)
    prox = jax.lax.stop_gradient(batch.prox_logp)
    ratio = jnp.exp(_masked_diff(logp, prox, m))  # [B, T]
    w, metrics = _token_weight(_masked_diff(prox, batch.behavior_logp, m), m, n, keep, cfg)
    pg, clipped = _clipped_surrogate(ratio, batch.advantages[:, None], cfg)
    pg = pg * w  # [B, T]
    pg_loss = aggregate(pg, m, n, keep)
    loss = pg_loss
    if batch.ref_logp is not None:
        k3 = _k3(logp, batch.ref_logp, m)  # [B, T]
        if cfg.kl_coef > 0:
            kl = k3 * ratio if cfg.kl_bias_correction else k3
            loss = loss + _beta(batch, cfg) * aggregate(kl, m, n, keep)
            metrics["kl_coef"] = jnp.asarray(_beta(batch, cfg), jnp.float32)
        metrics["kl"] = _masked_mean(k3, m)
    metrics.update(
        loss=loss,
        pg_loss=pg_loss,
        clip_frac=_masked_mean(clipped, m),
        ratio_mean=_masked_mean(ratio, m),
        tokens=m.sum(),
    )
    return loss, jax.lax.stop_gradient(metrics)


def _batch_mean(per_seq: jax.Array, keep: jax.Array) -> jax.Array:
    return (per_seq * keep).sum() / jnp.maximum(keep.sum(), 1.0)


# ------------------------------------------------------------------------------ losses


@register_loss("grpo")
def grpo_loss(logp, batch: LossInputs, cfg: LossConfig):
    def aggregate(x, m, n, keep):
        return _batch_mean((x * m).sum(axis=1) / jnp.maximum(n, 1.0), keep)

    return _token_level_loss(logp, batch, cfg, aggregate)


@register_loss("dr_grpo")
def dr_grpo_loss(logp, batch: LossInputs, cfg: LossConfig):
    const = float(logp.shape[1] if cfg.dr_grpo_constant is None else cfg.dr_grpo_constant)

    def aggregate(x, m, n, keep):
        return _batch_mean((x * m).sum(axis=1) / const, keep)

    return _token_level_loss(logp, batch, cfg, aggregate)


@register_loss("dapo")
def dapo_loss(logp, batch: LossInputs, cfg: LossConfig):
    def aggregate(x, m, n, keep):
        return (x * m).sum() / jnp.maximum(m.sum(), 1.0)

    return _token_level_loss(logp, batch, cfg, aggregate)


@register_loss("gspo")
def gspo_loss(logp, batch: LossInputs, cfg: LossConfig):
    _check(logp, batch, cfg)
    m, n, keep = _token_mask(batch)
    n1 = jnp.maximum(n, 1.0)  # [B]
    prox = jax.lax.stop_gradient(batch.prox_logp)
    s = jnp.exp(_masked_diff(logp, prox, m).sum(axis=1) / n1)  # [B]
    log_w = _masked_diff(prox, batch.behavior_logp, m).sum(axis=1)  # log rho_b  [B]
    mode = cfg.correction
    if mode != "seq_mis":  # GSPO's own length normalization: log g_b
        log_w = log_w / n1
    w, metrics = _is_weight(log_w, keep, cfg, "tis" if mode == "geo_seq" else mode)
    pg, clipped = _clipped_surrogate(s, batch.advantages, cfg)
    pg_loss = _batch_mean(pg * w, keep)
    loss = pg_loss
    if batch.ref_logp is not None:
        k3 = _k3(logp, batch.ref_logp, m)  # [B, T]
        if cfg.kl_coef > 0:
            kl = k3 * s[:, None] if cfg.kl_bias_correction else k3
            loss = loss + _beta(batch, cfg) * _batch_mean((kl * m).sum(axis=1) / n1, keep)
            metrics["kl_coef"] = jnp.asarray(_beta(batch, cfg), jnp.float32)
        metrics["kl"] = _masked_mean(k3, m)
    metrics.update(
        loss=loss,
        pg_loss=pg_loss,
        clip_frac=_masked_mean(clipped, keep),
        ratio_mean=_masked_mean(s, keep),
        tokens=m.sum(),
    )
    return loss, jax.lax.stop_gradient(metrics)
