"""The controller the training binary hosts: trajectories, staleness, leases, the fleet.

    ctl = serve.open_controller(config, workdir, task, codec, vocab_size, cursor)

Its state lives in `<workdir>/controller.db` (SQLite). A resumed run hands in the
checkpoint's cursor, which puts the groups consumed after that checkpoint back in the
buffer, before the HTTP service (`bridge.control.service.serve_controller`, started by the
binary) lets any worker in.
"""

from __future__ import annotations

import logging
import os

from bridge.control.controller import Controller, ControllerConfig
from bridge.control.protocol import SamplingParams

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
            max_tokens=b.max_answer_len,
            stop_token_ids=[eos_id],
        ),
        max_prompt_tokens=b.max_prompt_len,
        seed=config.seed,
        refuse_too_slow=config.controller.refuse_too_slow,
        retest_slow_after_s=config.controller.retest_slow_after_s,
    )


def open_controller(config, workdir: str, task, vocab_size: int, eos_id: int, cursor: dict):
    """The run's controller, with a checkpoint's RL cursor (if any) restored."""
    ctl = Controller(
        controller_config(config, vocab_size, eos_id), os.path.join(workdir, DB_FILE), task
    )
    if cursor:
        back = ctl.restore_cursor(cursor)
        logging.info("resumed the controller cursor (%d groups back in the buffer)", back)
    return ctl
