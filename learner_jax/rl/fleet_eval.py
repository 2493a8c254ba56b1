"""`eval.on=fleet`: held-out evaluation by the workers, the learner never waits for it.

    hook = evaluation_hook(config, ctl, task, eval_log, workdir, end)   # train.py's hooks

On the evaluation schedule (`rollout.eval_period` RL steps, and the last step) the hook
asks the controller to evaluate the version this step publishes (version = learner step;
on a step that publishes nothing, the newest announced one). Not the announced one: with
background publishing that is the previous version, which the workers leave as soon as
this step's lands, so its evaluation often found no worker on it (version 103 of the
first two-worker run never got one). It asks (bridge/control/eval_leases.py:
`eval.n` samples per held-out prompt at `eval.temperature`, only workers on exactly that
version take them, scored by the trusted scorer) and goes on training. Finished
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
`controller.audit_rescore_every=0`). Cost on the learner's thread: one version read from
the store and a 16-row forward per evaluated version (0.1-0.6 s on the 2-core CPU box,
where the tiny model's train step is ~0.5 s; BUILD_NOTES.md issue 26 follow-up).

With `task.eval_file` set, the held-out prompts are that benchmark file's, scored by
math-verify (bridge/tasks/eval_file.py) in the controller's reward pool.

`eval.on=learner` (the default) keeps the learner's own evaluator (evals.py) on the same
schedule.
"""

from __future__ import annotations

import logging

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
        publish_every=1,
    ):  # fmt: skip
        self.ctl, self.prompts, self.n, self.temperature = ctl, prompts, n, temperature
        self.period, self.end, self.start, self.eval_file = period, end, start, eval_file
        self.rescorer, self.publish_every = rescorer, max(1, int(publish_every))
        self.requested: set[int] = set()

    def after_step(self, learner, metrics: dict) -> dict:
        step = learner.step
        due = step >= self.end or (self.period and (step - self.start) % self.period == 0)
        version = metrics.get("policy_version")  # the Publish hook runs first
        if learner.rl_steps % self.publish_every == 0:
            version = learner.step  # published by this step (maybe still in the background)
        if due and version is not None and version >= 0 and version not in self.requested:
            self.requested.add(version)
            self.ctl.evaluation(
                "request", version, self.prompts, self.n, self.temperature, step=step,
                eval_file=self.eval_file,
            )  # fmt: skip
        out = {}
        for r in self.ctl.evaluation("take_results"):
            out.update({k: v for k, v in r.items() if k.startswith("eval/")})
            out["eval/version"] = r["version"]
            logging.info(
                "fleet eval of version %d: accuracy %.3f, pass@%d %.3f",
                r["version"], r["eval/accuracy"], r["n"], r["eval/pass@k"],
            )  # fmt: skip
        rows = self.ctl.evaluation("take_audit_rows")
        if rows and self.rescorer is not None and self.rescorer.every:
            stats = self.rescorer.rescore_eval(rows)
            if stats:
                self.ctl.audit(stats)
            out["audit/eval_rows"] = float(len(rows))
        return out


def evaluation_hook(config, ctl, task, eval_log, workdir: str, end: int, rescorer=None):
    """The after-step evaluation hook `eval.on` asks for."""
    if eval_place(config) == "learner":
        return hooks.Evaluate(eval_log)
    e = config.eval
    ctl.evaluation("configure", workdir)  # eval.jsonl, eval_samples.jsonl
    prompts = task.eval_prompts()
    path = str(config.task.get("eval_file", "") or "")
    if path:  # a benchmark file's prompts, scored by math-verify (bridge/tasks/eval_file.py)
        from bridge.tasks import make_task

        prompts = make_task("eval_file", path=path).eval_prompts()
    return FleetEval(
        ctl, prompts, int(e.get("n", 4)), float(e.get("temperature", 0.0)),
        config.rollout.eval_period, end, eval_log.rl_start, path,
        rescorer if bool(e.get("audit", True)) else None,
        int(config.get("publish_every", 1)),
    )  # fmt: skip
