"""The controller in a process of its own (issue 25): a long train step, a big publish or
the learner's GIL never delays a heartbeat.

    proc = ControllerProcess(cfg, workdir, task, codec, ServerOptions(...)).start()
    ctl = proc.controller   # the learner's handle: the same methods as Controller
    ...
    proc.stop()

The child (spawned, so no JAX or thread state is inherited) builds the `Controller` on
`<workdir>/controller.db`, serves workers over HTTP (`serve_controller`, which writes
`controller.json`), and serves the learner over loopback: a `multiprocessing.managers`
server on 127.0.0.1 with a random per-run authkey (HMAC challenge on connect), so only
this parent can call it. Calls and results are pickled; what the learner calls (batches,
publish, audit, cursor, status) is small next to a train step.

Failure: the parent checks `alive()`; a call into a dead child raises (EOFError,
ConnectionError), so the run stops instead of waiting forever. `restart()` starts a new
child on the same database: everything acknowledged is there (group commit, db.py), tokens
stay valid, workers that retried meanwhile carry on (tests/bridge/control/process_test.py
kills it with SIGKILL mid-run).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import secrets
import signal
import threading
import time
from multiprocessing.managers import BaseManager

DB_FILE = "controller.db"


class _Manager(BaseManager):
    pass


def _orphaned_exit(parent: int) -> None:
    """The learner died (even by SIGKILL): the controller goes too, freeing its port."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _child(cfg, workdir, task, codec, options, token_file, resume, logs, authkey, conn):
    from bridge.control.controller import Controller
    from bridge.control.http.service import serve_controller

    parent = os.getppid()
    threading.Thread(target=_orphaned_exit, args=(parent,), daemon=True).start()
    ctl = Controller(cfg, os.path.join(workdir, DB_FILE), task, codec=codec)
    back = ctl.restore_cursor(*resume) if resume is not None else 0  # before any worker
    server = serve_controller(ctl, workdir, options, token_file)
    if logs is not None:  # after uvicorn's dictConfig, which closes the handlers before it
        logs()  # the parent's routing (the training binary: console filter + train.log)
    if back:
        logging.info("resumed the controller cursor (%d groups back in the buffer)", back)
    _Manager.register("controller", callable=lambda: ctl)
    manager = _Manager(address=("127.0.0.1", 0), authkey=authkey)
    rpc = manager.get_server()
    conn.send((server.url, rpc.address))
    conn.close()

    def _stopped(*_):  # SIGTERM: the hot state in memory reaches the file first (hot_state.py)
        ctl.close()
        os._exit(0)

    signal.signal(signal.SIGTERM, _stopped)
    rpc.serve_forever()  # until the parent stops (SIGTERM) or kills it


class ControllerDied(RuntimeError):
    """The learner called the controller and its process was gone."""


class _Handle:
    """The learner's controller: calls go to the child; `config` is the parent's copy. A
    call into a dead child raises `ControllerDied`, saying so and how to resume, instead of
    the manager's bare EOFError / ConnectionResetError."""

    def __init__(self, proxy, config, died):
        self._proxy, self.config, self._died = proxy, config, died

    def __getattr__(self, name):
        attr = getattr(self._proxy, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            try:
                return attr(*args, **kwargs)
            except (EOFError, ConnectionError) as e:
                raise ControllerDied(self._died()) from e

        return call


class ControllerProcess:
    def __init__(
        self,
        cfg,
        workdir: str,
        task,
        codec,
        options,
        token_file: str | None = None,
        resume: tuple[dict, int] | None = None,
        logs=None,
    ):
        """`resume`: (cursor, version) for `Controller.restore_cursor` at the first start
        (a restart after a crash resumes from the database as it is). `logs`: a picklable
        callable the child runs first to route its logging (e.g. into the run's log file)."""
        self.args = (cfg, workdir, task, codec, options, token_file)
        self._resume, self._logs = resume, logs
        self.config = cfg
        self._authkey = secrets.token_bytes(32)
        self._proc: multiprocessing.Process | None = None
        self.url = ""
        self.controller: _Handle | None = None

    def start(self, timeout_s: float = 120.0) -> ControllerProcess:
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_child,
            args=(*self.args, self._resume, self._logs, self._authkey, theirs),
            name="controller",
        )
        self._resume = None  # once: a restart resumes from the database
        self._proc.start()
        theirs.close()
        if not ours.poll(timeout_s):
            self.kill()
            raise RuntimeError("the controller process did not start")
        try:
            self.url, address = ours.recv()
        except EOFError:
            raise RuntimeError(f"the controller process died ({self._proc.exitcode})") from None
        _Manager.register("controller")
        manager = _Manager(address=address, authkey=self._authkey)
        manager.connect()
        self.controller = _Handle(manager.controller(), self.config, self._death)
        return self

    def _death(self) -> str:
        if self._proc is not None:
            self._proc.join(1.0)
        code = self._proc.exitcode if self._proc is not None else None
        db = os.path.join(self.args[1], DB_FILE)
        return (
            f"the controller process (pid {self.pid}) died (exit code {code}); everything "
            f"acknowledged is in {db}: rerun the same command to resume"
        )

    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def kill(self) -> None:
        """SIGKILL, as a crash would (tests, and the last resort of `stop`)."""
        if self._proc is not None and self._proc.is_alive():
            os.kill(self._proc.pid, signal.SIGKILL)
            self._proc.join(10)

    def restart(self, timeout_s: float = 120.0) -> ControllerProcess:
        """A new child on the same database and port (after a crash): resumes from SQLite;
        workers keep their URL and tokens."""
        self.kill()
        if self.url:
            cfg, workdir, task, codec, options, token_file = self.args
            port = int(self.url.rsplit(":", 1)[1])
            options = dataclasses.replace(options, port=port)
            self.args = (cfg, workdir, task, codec, options, token_file)
        return self.start(timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._proc is None:
            return
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(timeout_s)
        self.kill()
        self._proc = None
