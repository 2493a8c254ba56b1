"""The controller the training binary hosts: trajectories, staleness, leases, the fleet.

    cfg = run_config.controller_config(config, vocab_size, codec.eos_id)
    ctl = serve.open_controller(cfg, workdir, task, codec, cursor, step)

Its state lives in `<workdir>/controller.db` (SQLite). A resumed run hands in the
checkpoint's cursor, which puts the groups consumed after that checkpoint back in the
buffer, before the HTTP service (`bridge.control.http.service.serve_controller`, started by the
binary) lets any worker in.
"""

from __future__ import annotations

import functools
import logging
import os

from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller

DB_FILE = "controller.db"


def open_controller(
    cfg: ControllerConfig, workdir: str, task, codec, cursor: dict | None, version: int
) -> Controller:
    """The run's controller, with a checkpoint's RL cursor restored and what a crashed run
    did past that checkpoint (`version`, the learner's step) rolled back.

    Without a cursor (no RL checkpoint yet) every consumption in an existing database is
    undone: a run that died before its first RL checkpoint trains on those groups again.
    `codec` (the run's tokenizer) lets the controller build every prompt's token ids and
    decode completions to score them itself: the trusted side never takes either from a
    worker."""
    ctl = Controller(cfg, os.path.join(workdir, DB_FILE), task, codec=codec)
    if not cursor:
        cursor = {"next_step": version, "consumed_through_step": version - 1, "prompts_drawn": 0}
    back = ctl.restore_cursor(cursor, version)
    if back:
        logging.info("resumed the controller cursor (%d groups back in the buffer)", back)
    return ctl


def start_controller(cfg: ControllerConfig, run, resume, serving, own_process: bool = False):
    """The run's controller and its HTTP service: (handle, server, closers in the order to
    register them). `run` = (workdir, task, codec), `resume` = (cursor, version) as for
    `open_controller`, `serving` = (ServerOptions, token_file). `own_process`
    (`controller.own_process`, bridge/control/process.py): in a process of its own, the
    learner calling it over loopback; `server` is then the `ControllerProcess`."""
    workdir, task, codec = run
    options, token_file = serving
    if own_process:
        from bridge.control.process import ControllerProcess

        cursor, version = resume
        if not cursor:
            cursor = {"next_step": version, "consumed_through_step": version - 1}
            cursor["prompts_drawn"] = 0
        logs = functools.partial(_child_logging, workdir)
        proc = ControllerProcess(
            cfg, workdir, task, codec, options, token_file, resume=(cursor, version), logs=logs
        ).start()
        return proc.controller, proc, [proc.stop]
    from bridge.control.http.service import serve_controller

    ctl = open_controller(cfg, workdir, task, codec, *resume)
    server = serve_controller(ctl, workdir, options, token_file)
    return ctl, server, [ctl.close, server.stop]


def end_run(ctl, reason: str, tell: bool = True, drain_s: float | None = None) -> bool:
    """The run's end as the workers hear it; True if every live worker heard it.

    `tell` (`controller.tell_run_over`, default True): record the end, so every heartbeat
    and lease answers "run over" and the workers leave and exit 0, and wait up to `drain_s`
    (default three heartbeat intervals, at least 10 s) for the polling ones to hear it.
    False: say nothing. Workers started outside the binary (`local_workers=0`, a standing
    pool) then see the controller go away and rejoin the next run served at the same
    address and join secret, as after a crash: the new controller's fresh database refuses
    their old token and leases, they register again and load its announced version
    (bench/staleness_sweep.py runs its cells so). The binary's own workers stop either way."""
    if not tell:
        logging.info("run %s; the workers are not told (controller.tell_run_over=False)", reason)
        return False
    ctl.end_run(reason)
    if drain_s is None:
        drain_s = max(10.0, 3 * ctl.config.heartbeat_interval_s)
    return ctl.wait_run_over_seen(timeout_s=drain_s)


def _child_logging(workdir: str) -> None:
    """In the controller's own process: the binary's console filter and `train.log`
    (appended by both processes, a line at a time), as when it shared the learner's."""
    from learner_jax import console

    console.setup()
    console.log_to_file(workdir)
