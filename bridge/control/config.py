"""The controller's settings (bridge/control/controller.py), one frozen dataclass.

The training binary builds it from `config` (learner_jax/rl/serve.py); tests and benches
build it directly. `m` (`max_version_lag`): how many versions behind the newest a worker may
be and still get work (one more while it fetches the newest in the background).
"""

from __future__ import annotations

import dataclasses

from bridge.contracts import exact_check as exact_rule
from bridge.control.protocol import SamplingParams


@dataclasses.dataclass(frozen=True)
class ControllerConfig:
    staleness: int = 2  # S (with `staleness_auto`: where it starts)
    # `staleness="auto"`: S moves within [staleness_min, staleness_max] (auto_staleness.py).
    staleness_auto: bool = False
    staleness_min: int = 0
    staleness_max: int = 0
    groups_per_step: int = 8  # prompt groups the learner consumes per step
    group_size: int = 4  # samples per prompt (GRPO n)
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    vocab_size: int = 128
    max_prompt_tokens: int = 256
    lease_ttl_s: float = 60.0
    heartbeat_interval_s: float = 5.0  # the shortest; grows with the fleet (see next)
    # Fleet-wide heartbeats/s the controller aims at: the interval it tells workers is
    # live workers / this, within [heartbeat_interval_s, worker_timeout_s / 3], so load
    # grows with work (leases, submissions), not with idle workers. 0: always the shortest.
    heartbeat_budget_per_s: float = 50.0
    worker_timeout_s: float = 30.0
    # Heartbeat state (last contact, gauges, lease deadlines) is kept in memory and written
    # to SQLite at most this far apart (bridge/control/hot_state.py); 0: no flusher thread,
    # only before reads and at close.
    hot_flush_s: float = 2.0
    max_groups_per_lease: int = 16
    max_version_lag: int = 0  # m above
    refuse_too_slow: bool = True  # freshness-aware leasing (bridge/control/lease_timing.py)
    retest_slow_after_s: float = 60.0  # a too-slow worker's latency is re-measured this often
    retry_after_s: float = 0.5
    # Fleet-wide lease asks/s aimed at from workers refused for a full admission window:
    # each is told to ask again after retry_after_s plus up to waiting workers / this
    # (refusal_pacing.py). 0: no spread.
    lease_retry_budget_per_s: float = 100.0
    seed: int = 0
    reward_timeout_s: float = 5.0  # per completion, in the reward pool (rewards.py)
    # A multi-turn task's episode budget: completion tokens in all, model and environment
    # (each model turn then samples at most sampling.max_tokens and the task's
    # turn_max_tokens). 0 = sampling.max_tokens.
    max_completion_tokens: int = 0
    # Quarantine past these (audit.py; the defaults are measured in BUILD_NOTES.md).
    audit_kl_threshold: float = 0.01  # mean k3 per token
    audit_logratio_threshold: float = 0.1  # |mean behaviour - learner log-prob| per token
    audit_min_tokens: int = 256  # audited tokens before a verdict
    audit_window_tokens: int = 4096  # the per-worker score's decay horizon
    # The sampling check (bridge/contracts/sampling_check.py): quarantine a worker whose
    # tokens' likelihood under the policy is |Z| past this (not sampled by it); 0 = off.
    audit_sampling_z: float = 6.0
    # ... and its evidence test (any token count): the CUSUM of log e-values past this
    # (ln of 1 / the false-alarm rate per stat) quarantines; 0 = off.
    audit_sampling_evidence: float = 23.0
    # The exact check (bridge/contracts/exact_check.py): a group with a token that is not
    # the seeded sampler's choice never trains; this many such tokens from one identity
    # quarantine it (0 = never), and a token counts as the sampler's choice within
    # exact_margin + exact_margin_rel x max |logit| of the Gumbel argmax (engine numerics).
    exact_check: bool = True
    exact_quarantine_tokens: int = exact_rule.QUARANTINE_TOKENS
    exact_quarantine_fraction: float = exact_rule.QUARANTINE_FRACTION
    exact_flip_tokens: int = exact_rule.FLIP_TOKENS
    exact_flip_fraction: float = exact_rule.FLIP_FRACTION
    exact_margin: float = exact_rule.MARGIN_ABS
    exact_margin_rel: float = exact_rule.MARGIN_REL
    # Cost-aware activation (fleet_plan.py): the cheapest set covering (1 + margin) * R / T.
    activation: bool = False
    activation_margin: float = 0.1
    activation_period_s: float = 30.0  # re-solve at most this often on heartbeats
    standby_price_fraction: float = 0.0  # standby workers' billing (0: released, not billed)
    # Abuse limits (limits.py; 0 = off): 10x an honest worker's pace at the defaults.
    rate_limit_per_s: float = 20.0  # per worker and endpoint, sustained
    rate_limit_burst: float = 60.0
    register_rate_per_s: float = 1.0  # registrations per client IP
    register_burst: float = 64.0
    # Per registering identity (a credential, or a remote host presenting the shared secret;
    # not the operator's own machine, bridge/control/identity.py): registrations at once and
    # sustained, and a remote host's live workers at a time (a credential holds one).
    register_identity_burst: float = 4.0
    register_identity_rate_per_s: float = 0.05
    max_live_workers_per_address: int = 8
    max_leases_per_worker: int = 4  # active leases one worker may hold
    # Environment replays (POST /v1/episode, episode_steps.py) per worker: sustained and at
    # once; a request over it is answered 429. A request needing more than the burst empties
    # a full bucket, so any one lease's turn gets through. 0 = off. A Kuhn poker replay
    # costs ~0.16 ms of a reward-pool process (measured on a loaded 2-core box): one worker
    # takes at most ~1/6 of a pool process sustained; the burst is one maximal request.
    episode_replays_per_s: float = 1000.0
    episode_replay_burst: float = 4096.0
    token_ttl_s: float = 900.0  # a token dies this long after its worker's last contact
    join_secret_grace_s: float = 600.0  # a rotated-out join secret still works (join_secret.py)
    # Weight broadcast (bridge/broadcast): "store" (every worker reads the store), "chain"
    # or "tree" (workers relay chunks to each other; the store's uplink carries one copy).
    broadcast: str = "store"
    broadcast_fanout: int = 2  # tree fan-out f
    broadcast_bad_limit: int = 2  # corrupt-chunk reports that take a relay out of the tree
