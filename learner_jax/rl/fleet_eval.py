"""`eval.on=fleet`: held-out evaluation by the workers; the learner waits for it only
after its last step (`eval.final_wait_s`).

    hook = evaluation_hook(config, ctl, task, eval_log, workdir, end)   # train.py's hooks
    final_wait(hook)                                                    # after the RL loop

On the evaluation schedule (`rollout.eval_period` RL steps, and the last step) the hook
asks the controller to evaluate the version this step publishes (version = learner step;
on a step that publishes nothing, the newest announced one). Not the announced one: with
background publishing that is the previous version, which the workers leave as soon as
this step's lands, so its evaluation often found no worker on it (version 103 of the
first two-worker run never got one). It asks (bridge/control/evaluation/eval_leases.py:
`eval.n` samples per held-out prompt at `eval.temperature`, only workers on exactly that
version take them when rollouts leave them idle, scored by the trusted scorer; a version
no live worker is on any more is evaluated at the newest) and goes on training. Finished
evaluations arrive on later steps: their eval/accuracy, eval/pass@1, eval/pass@k,
eval/mean_length, eval/think_length (and eval/version, the version they measured) join
that step's metrics line, and their summaries are in `<workdir>/eval.jsonl` (tag "fleet",
plotted by the report like the learner's own) with per-prompt lines in
`eval_samples.jsonl`.

Audit: the controller keeps a sample of each evaluated version's trajectories (worker
log-probs included); the hook re-scores them under that version (`rescore.VersionRescorer.
rescore_eval`) and sends the per-worker sums to `ctl.audit` like the train step's, so an
eval worker with wrong log-probs is quarantined like a rollout worker
(`audit/eval_rows` counts them; off with `eval.audit=False` or
`controller.audit_rescore_every=0`).

Off the learner's loop: a background thread (started at the first request) polls the
controller every `poll_s` for finished evaluations and audit rows, runs the re-score (a
version read from the store and a 16-row forward, 0.1-0.6 s on the 2-core CPU box) and
sends the verdicts; `after_step` only drains what it brought (no controller call) and
asks for an evaluation every `rollout.eval_period` steps. In the learner's loop the two
polling calls per step (to a controller in its own process) and the re-score were idle
time that eval off does not have.

The run's end (`finish`, train.py): the evaluation asked at the last step (and any other
still pending) is waited for, up to `eval.final_wait_s` seconds, before the workers are
told the run is over (the learner no longer consumes: admission fills and the workers'
idle capacity goes to evaluation), so eval.jsonl has the final version; past the limit a
warning names the versions missing.

With `task.eval_file` set, the held-out prompts are that benchmark file's, scored by
math-verify (bridge/tasks/eval_file.py) in the controller's reward pool.

`eval.on=learner` (the default) keeps the learner's own evaluator (evals.py) on the same
schedule.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from learner_jax import console
from learner_jax.rl import hooks

PLACES = ("learner", "fleet")


def eval_place(config) -> str:
    e = config.get("eval")
    place = str(e.get("on", "learner")) if e is not None else "learner"
    if place not in PLACES:
        raise ValueError(f"eval.on must be one of {PLACES}, got {place!r}")
    return place


class FleetEval:
    def __init__(
        self, ctl, prompts, n, temperature, period, end, start, eval_file="", rescorer=None,
        publish_every=1, final_wait_s=120.0, poll_s=0.5, exact=None,
    ):  # fmt: skip
        """`exact`: the run's ExactChecker (exact_check.py); with it every eval group counts
        only after its tokens were checked (the controller holds it until `verified`)."""
        self.ctl, self.prompts, self.n, self.temperature = ctl, prompts, n, temperature
        self.period, self.end, self.start, self.eval_file = period, end, start, eval_file
        self.rescorer, self.publish_every = rescorer, max(1, int(publish_every))
        self.exact = exact
        self.requested: set[int] = set()
        self.final_wait_s, self.poll_s = float(final_wait_s), float(poll_s)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # metrics from the poller
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._failing = False  # the poller's controller calls fail (logged once a streak)

    def after_step(self, learner, metrics: dict) -> dict:
        """Ask for this step's evaluation when due (one controller call, every
        `rollout.eval_period` steps); the metrics the background poller brought in."""
        step = learner.step
        due = step >= self.end or (self.period and (step - self.start) % self.period == 0)
        version = metrics.get("policy_version")  # the Publish hook runs first
        if learner.rl_steps % self.publish_every == 0:
            version = learner.step  # published by this step (maybe still in the background)
        if due and version is not None and version >= 0 and version not in self.requested:
            self.requested.add(version)
            self.ctl.request_eval(
                version, self.prompts, self.n, self.temperature, step=step,
                eval_file=self.eval_file,
            )  # fmt: skip
            if self._poller is None:
                self._poller = threading.Thread(target=self._poll, name="fleet-eval", daemon=True)
                self._poller.start()
        return self._drain()

    def _poll(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._collect()

    def _collect(self) -> None:
        """Off the learner's thread: finished evaluations' metrics to the inbox, and their
        sampled rows re-scored and the verdicts sent to the controller (`ctl.audit`)."""
        try:
            if self.exact is not None:
                self._check_exact()
            out = {}
            for r in self.ctl.take_eval_results():
                out.update({k: v for k, v in r.items() if k.startswith("eval/")})
                out["eval/version"] = r["version"]
                logging.info(
                    "fleet eval of version %d (asked for %s): accuracy %.3f, pass@%d %.3f",
                    r["version"], r.get("requested", [r["version"]]), r["eval/accuracy"],
                    r["n"], r["eval/pass@k"],
                )  # fmt: skip
            if out:
                self._inbox.put(out)
            rows = self.ctl.take_eval_audit_rows()
            if rows and self.rescorer is not None and self.rescorer.every:
                stats = self.rescorer.rescore_eval(rows)
                if stats:
                    self.ctl.audit(stats)
                self._inbox.put({"audit/eval_rows": float(len(rows))})
            self._failing = False
        except Exception as e:  # noqa: BLE001 - the controller restarting: try again later
            if not self._failing:
                logging.warning("fleet eval: polling the controller failed: %s", e)
            self._failing = True

    def _check_exact(self) -> None:
        """Every scored eval group's tokens under its version and its lease's seed (greedy:
        the argmax); the verdict to the controller, the counts to the audit."""
        from bridge.control.protocol import ConsumedGroup

        rows = self.ctl.take_eval_check_rows()
        accepted, refused, checked = [], [], 0.0
        for temperature in sorted({r["temperature"] for r in rows}):
            groups = [
                ConsumedGroup(group_id=r["group_id"], prompt_id="", prompt="", answer="",
                              trajectories=r["trajectories"], worker_id=r["worker"],
                              sampling_seed=r["seed"],
                              engine_dtype=r.get("engine_dtype", "bfloat16"))
                for r in rows if r["temperature"] == temperature
            ]  # fmt: skip
            verdict = self.exact.check(groups, temperature=temperature)
            self.ctl.audit(verdict.stats)
            refused += sorted(verdict.refused)
            accepted += [g.group_id for g in groups if g.group_id not in verdict.refused]
            checked += verdict.metrics["exact/checked_tokens"]
        if rows:
            self.ctl.eval_verified(accepted, refused)
            self._inbox.put({"eval/exact_refused_groups": float(len(refused)),
                             "eval/exact_checked_tokens": checked})  # fmt: skip

    def _drain(self) -> dict:
        out: dict = {}
        while True:
            try:
                got = self._inbox.get_nowait()
            except queue.Empty:
                return out
            rows = out.get("audit/eval_rows", 0.0) + got.get("audit/eval_rows", 0.0)
            out.update(got)
            if rows:
                out["audit/eval_rows"] = rows

    def close(self) -> None:
        """Stop the poller (after its current call)."""
        self._stop.set()
        if self._poller is not None:
            self._poller.join()

    def finish(self, timeout_s: float, poll_s: float = 0.2) -> dict:
        """Wait up to `timeout_s` for every pending evaluation (the last step's included) and
        the audit of its rows; returns the eval metrics not yet on a metrics line."""
        self.close()  # from here on this thread polls
        deadline = time.monotonic() + timeout_s
        waiting = self.ctl.pending_eval_versions()
        if waiting:
            logging.info(
                "waiting up to %.0fs (eval.final_wait_s) for the fleet evaluation of "
                "version(s) %s", timeout_s, waiting, extra=console.SHOW,
            )  # fmt: skip
        while True:
            self._collect()
            waiting = self.ctl.pending_eval_versions()
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(poll_s)
        if waiting:
            logging.warning(
                "gave up waiting for the fleet evaluation of version(s) %s after %.0fs "
                "(eval.final_wait_s): eval.jsonl lacks them", waiting, timeout_s,
            )  # fmt: skip
        self._collect()
        return self._drain()


def final_wait(hook, wait: bool = True) -> dict:
    """train.py at the run's end: `FleetEval.finish` for `eval.on=fleet` (`wait` False,
    e.g. after Ctrl-C: only stop its poller), else nothing."""
    if not isinstance(hook, FleetEval):
        return {}
    if not wait:
        hook.close()
        return {}
    return hook.finish(hook.final_wait_s)


def evaluation_hook(config, ctl, task, eval_log, workdir: str, end: int, rescorer=None, exact=None):
    """The after-step evaluation hook `eval.on` asks for (`exact`: the run's ExactChecker,
    None with controller.exact_check off)."""
    if eval_place(config) == "learner":
        return hooks.Evaluate(eval_log)
    e = config.eval
    final_wait_s = float(e.get("final_wait_s", 120.0))
    if not final_wait_s >= 0:
        raise ValueError(f"eval.final_wait_s must be >= 0 seconds, got {final_wait_s}")
    ctl.configure_eval(workdir)  # eval.jsonl, eval_samples.jsonl
    prompts = task.eval_prompts()
    path = str(config.task.get("eval_file", "") or "")
    if path:  # a benchmark file's prompts, scored by math-verify (bridge/tasks/eval_file.py)
        from bridge.tasks import make_task

        prompts = make_task("eval_file", path=path).eval_prompts()
    return FleetEval(
        ctl, prompts, int(e.get("n", 4)), float(e.get("temperature", 0.0)),
        config.rollout.eval_period, end, eval_log.rl_start, path,
        rescorer if bool(e.get("audit", True)) else None,
        int(config.get("publish_every", 1)), final_wait_s, exact=exact,
    )  # fmt: skip
