"""The controller the training binary hosts: trajectories, staleness, leases, the fleet.

    ctl = serve.open_controller(config, workdir, task, codec, vocab_size, cursor, step)

Its state lives in `<workdir>/controller.db` (SQLite). A resumed run hands in the
checkpoint's cursor, which puts the groups consumed after that checkpoint back in the
buffer, before the HTTP service (`bridge.control.service.serve_controller`, started by the
binary) lets any worker in.
"""

from __future__ import annotations

import json
import logging
import os

from bridge.broadcast.topology import resolve_mode
from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.protocol import SamplingParams
from bridge.store.weight_store import parse_spec

DB_FILE = "controller.db"


def controller_config(config, vocab_size: int, eos_id: int) -> ControllerConfig:
    b = config.batch
    return ControllerConfig(
        staleness=config.staleness,
        groups_per_step=b.groups_per_step,
        group_size=b.samples_per_group,
        vocab_size=vocab_size,
        sampling=SamplingParams(
            temperature=float(config.rollout.temperature),
            top_p=float(config.rollout.get("top_p", 1.0)),
            top_k=int(config.rollout.get("top_k", -1)),
            max_tokens=b.max_answer_len,
            stop_token_ids=[eos_id],
        ),
        # a multi-turn episode (model and environment tokens) fits one learner row too
        max_completion_tokens=b.max_answer_len,
        max_prompt_tokens=b.max_prompt_len,
        seed=config.seed,
        refuse_too_slow=config.controller.refuse_too_slow,
        retest_slow_after_s=config.controller.retest_slow_after_s,
        reward_timeout_s=config.controller.reward_timeout_s,
        activation=config.controller.activation,
        activation_margin=config.controller.activation_margin,
        activation_period_s=config.controller.activation_period_s,
        standby_price_fraction=config.controller.standby_price_fraction,
        rate_limit_per_s=config.controller.rate_limit_per_s,
        rate_limit_burst=config.controller.rate_limit_burst,
        register_rate_per_s=config.controller.register_rate_per_s,
        register_burst=config.controller.register_burst,
        max_leases_per_worker=config.controller.max_leases_per_worker,
        token_ttl_s=config.controller.token_ttl_s,
        join_secret_grace_s=config.controller.join_secret_grace_s,
        broadcast=broadcast_mode(config),
        broadcast_fanout=config.bridge.broadcast_fanout,
    )


def broadcast_mode(config) -> str:
    """`bridge.broadcast` with "auto" resolved against the run's store ('' = the workdir's)."""
    spec = str(config.bridge.store or "")
    if not spec:  # <workdir>/weights
        return resolve_mode(config.bridge.broadcast, "file")
    driver = parse_spec(json.loads(spec) if spec.startswith("{") else spec)["driver"]
    return resolve_mode(config.bridge.broadcast, driver)


def open_controller(
    config, workdir: str, task, codec, vocab_size: int, cursor: dict | None, version: int
):
    """The run's controller, with a checkpoint's RL cursor restored and what a crashed run
    did past that checkpoint (`version`, the learner's step) rolled back.

    Without a cursor (no RL checkpoint yet) every consumption in an existing database is
    undone: a run that died before its first RL checkpoint trains on those groups again.
    `codec` (the run's tokenizer) lets the controller build every prompt's token ids and
    decode completions to score them itself: the trusted side never takes either from a
    worker."""
    ctl = Controller(
        controller_config(config, vocab_size, codec.eos_id),
        os.path.join(workdir, DB_FILE),
        task,
        codec=codec,
    )
    if not cursor:
        cursor = {"next_step": version, "consumed_through_step": version - 1, "prompts_drawn": 0}
    back = ctl.restore_cursor(cursor, version)
    if back:
        logging.info("resumed the controller cursor (%d groups back in the buffer)", back)
    return ctl
