"""What runs after each RL update, behind one protocol: the training loop knows no part.

    hooks = [Publish(publisher, ctl), Audit(ctl, source, rescorer), Evaluate(eval_log),
             Fleet(follower, source)]
    metrics.update(after_step(hooks, learner, metrics))      # train.run_rl, every step

Each hook gets the learner (its new state: step, params, the step's audit rows, the newest
checkpoint) and the step's metrics so far, including what the hooks before it returned
(the controller's learner report needs the publish time), and returns metrics to add.
Order is the list's: publish first (workers wait for the version), the fleet last.

The hooks only adapt the parts (weights.py, serve.py's controller, batches.py, rescore.py,
evals.py, fleet.py) to the protocol; like the parts, they import none of them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Protocol

from bridge.control.trust import audit
from learner_jax.reporting import compiles


class AfterStep(Protocol):
    def after_step(self, learner, metrics: dict) -> dict | None:
        """Run after the update that brought `learner` to `learner.step`; metrics to add."""


def after_step(hooks: Iterable[AfterStep], learner, metrics: dict) -> dict:
    """Run `hooks` in order; each sees the metrics the ones before it added."""
    out: dict = {}
    for hook in hooks:
        out.update(hook.after_step(learner, {**metrics, **out}) or {})
    return out


class Publish:
    """Publish every kappa RL steps, then tell the controller what its capacity model needs:
    T (the train step, not the step period, which includes waiting for data), the learner's
    own time since the previous step, the publish time, and whether XLA compiled meanwhile
    (compiles.py: a one-off, so those times are not warm samples); and for auto S's KL
    ceiling the step's `staleness/kl`."""

    def __init__(self, publisher, ctl):
        self.publisher, self.ctl = publisher, ctl
        self._last_wall: float | None = None
        self._compiles = compiles.count()

    def after_step(self, learner, metrics: dict) -> dict:
        wall = time.time()  # the window of the report: from the previous step's `wall` to this
        seen, self._compiles = self._compiles, compiles.count()
        out = {"time/wall": wall, **self.publisher.after_step(learner.rl_steps)}
        out["policy_version"] = self.ctl.announcement().version
        # The learner's own time outside train steps and waits for data since the previous
        # step (the previous step's publish, evaluation, checkpoint, taking and building
        # this batch): the learner is on the critical path then too, so the capacity model
        # counts it (taking the batch was ~70 ms a step of the demo's "wait").
        overhead = None
        if self._last_wall is not None:
            # Waiting for data is the fleet's; taking and building the batch is ours.
            waited = metrics.get("time/data_wait_s", metrics.get("time/wait_s", 0.0))
            busy = metrics["time/step_s"] + waited
            overhead = max(0.0, wall - self._last_wall - busy)
        self._last_wall = wall
        self.ctl.report_learner(
            metrics["time/step_s"],
            out.get("bridge/publish_s"),
            overhead,
            cold=self._compiles > seen,
            staleness_kl=metrics.get("staleness/kl"),
        )
        return out


class Audit:
    """Audit each worker's behaviour log-probs against the learner's own, whether its
    tokens look sampled from the policy (bridge/contracts/sampling_check.py) and, for a MoE
    policy, whether its recorded routing is the learner's own (bridge/contracts/routing.py),
    on the rows the learner's pre-update version sampled (the step recomputed them anyway), and on a
    sampled re-score of rows tagged with older versions (every step for workers not yet
    judged: rescore.py's focus). A worker past the thresholds is
    quarantined (and logged) by the controller."""

    def __init__(self, ctl, source, rescorer):
        self.ctl, self.source, self.rescorer = ctl, source, rescorer

    def after_step(self, learner, metrics: dict) -> dict:
        r, version = learner.last_rows, learner.step - 1
        stats = audit.row_sums_to_worker_stats(
            self.source.last_row_workers,
            r["tokens"] > 0,
            r["k3"],
            r["logratio"],
            r["tokens"],
            version=version,
            row_dev=r.get("dev"),
            row_var=r.get("var"),
            row_evidence=r.get("evidence"),
            # A MoE step's check of recorded routing against the learner's own top-k.
            row_routing_agree=r.get("routing_agree"),
            row_routing_rows=r.get("routing_tokens"),
        )
        self.ctl.audit(stats)
        self.rescorer.note(stats)  # which workers the re-score must look at next
        older = self.rescorer.maybe(learner.rl_steps, self.source.last_groups, version)
        if not older:
            return {}
        self.ctl.audit(older)
        return dict(self.rescorer.last)


class Evaluate:
    """Held-out evaluation on its schedule (evals.py)."""

    def __init__(self, eval_log):
        self.eval_log = eval_log

    def after_step(self, learner, metrics: dict) -> dict:
        acc = self.eval_log.maybe()
        if acc is None:
            return {}
        # eval/expected_reward and the optimum for exactly evaluable tasks (Kuhn poker).
        return {"eval/accuracy": acc, **self.eval_log.extras}


class Fleet:
    """Replace dead workers and follow activation (every period_s), and free the
    trajectories the newest durable checkpoint holds."""

    def __init__(self, follower, source):
        self.follower, self.source = follower, source

    def after_step(self, learner, metrics: dict) -> None:
        self.follower.check()
        self.source.checkpointed(learner.ckpt.latest_step())
