"""The controller's settings (bridge/control/controller.py), one frozen dataclass.

The training binary builds it from `config` (learner_jax/rl/serve.py); tests and benches
build it directly. Besides the fields below, which the binary fills from other sections
(the batch shape, sampling, the weight broadcast), every `controller.*` key declared with
ControllerConfig among its readers in bridge/config/keys.py is a field, with the default and
doc declared there: leasing and pacing, the audit and exact-check thresholds, activation,
the abuse limits.
"""

from __future__ import annotations

import dataclasses

from bridge.config.keys import SCHEMA
from bridge.control.intake.validation import RoutingRule
from bridge.control.protocol import SamplingParams


@dataclasses.dataclass(frozen=True)
@SCHEMA.declared_fields
class ControllerConfig:
    staleness: int = 2  # S (with `staleness_auto`: where it starts)
    # `staleness="auto"`: S moves within [staleness_min, staleness_max] (leasing/auto_staleness.py).
    staleness_auto: bool = False
    staleness_min: int = 0
    staleness_max: int = 0
    staleness_kl_max: float = 0.0  # auto S's KL ceiling (`staleness_kl_max`; 0: none)
    # `rollout.partial`: "continue" = workers continue unfinished samples under each newer
    # version; a group is then judged by its newest token (bridge/contracts/staleness.py).
    partial: str = "off"
    groups_per_step: int = 8  # prompt groups the learner consumes per step
    group_size: int = 4  # samples per prompt (GRPO n)
    sampling: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    vocab_size: int = 128
    max_prompt_tokens: int = 256
    seed: int = 0
    # A multi-turn task's episode budget: completion tokens in all, model and environment
    # (each model turn then samples at most sampling.max_tokens and the task's
    # turn_max_tokens). 0 = sampling.max_tokens.
    max_completion_tokens: int = 0
    # Weight broadcast (bridge/broadcast): "store" (every worker reads the store), "chain"
    # or "tree" (workers relay chunks to each other; the store's uplink carries one copy).
    broadcast: str = "store"
    broadcast_fanout: int = 2  # tree fan-out f
    # A MoE policy's recorded routing (bridge/control/intake/validation.py: RoutingRule):
    # its shape, and whether every trajectory must carry it (model.moe.routing_replay).
    routing: RoutingRule = dataclasses.field(default_factory=RoutingRule)
