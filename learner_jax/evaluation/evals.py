"""Held-out accuracy during RL, one line per evaluation in `<workdir>/eval.jsonl`.

    log = EvalLog(evaluator, learner, workdir, end=..., period=...)
    log.ensure("before")     # right after SFT, once per workdir
    acc = log.maybe()        # every `period` RL steps and at `end` (else None)
    log.final()              # "after" (finished) or "stop" (interrupted)

The learner's current params are evaluated (`learner_jax/evaluation/evaluate.py`: decoding in JAX
with a KV cache on the task's held-out prompts; greedy, or `eval.n` samples per prompt at
`eval.temperature`). Each row has `accuracy` and the fleet's eval/ metrics (pass@1,
pass@k, mean_length), which also join that step's metrics line.

Tags: "before" = after SFT, "rl" = during RL, "after" = at the end, "stop" = the step an
interrupted run stopped at. A resumed run reads the file, so it neither re-measures the
"before" accuracy nor repeats a final one already recorded for this step.
"""

from __future__ import annotations

import json
import logging
import os
import time

from learner_jax.reporting.metrics import read_jsonl

EVAL_FILE = "eval.jsonl"


class EvalLog:
    def __init__(
        self, evaluator, learner, workdir: str, *, end: int, period: int, exact=None, mirror=None
    ):
        """`exact`: an `evaluate.ExactEvaluator` (tasks with an exact expected reward, e.g.
        Kuhn poker): each row then also has `expected_reward` and `optimum`, and
        `extras` the matching `eval/` metrics of the newest evaluation. `mirror`: process
        0's `mirror.Leader` in a multi-process run (the others join each decode)."""
        self.evaluator, self.learner, self.exact, self.mirror = evaluator, learner, exact, mirror
        self.extras: dict[str, float] = {}
        self.path = os.path.join(workdir, EVAL_FILE)
        self.rl_start, self.end, self.period = learner.cursor["rl_start_step"], end, period

    def by_tag(self) -> dict[str, dict]:
        """The last row of each tag."""
        return {row["tag"]: row for row in read_jsonl(self.path)}

    def run(self, tag: str) -> float:
        t0, lrn = time.perf_counter(), self.learner
        if self.mirror is not None:
            # The other processes join the decode (learner_jax/multihost/mirror.py).
            self.mirror.eval()
        summary = self.evaluator.summary(lrn.policy_params, lrn.mesh, lrn.rules)
        acc = summary["eval/accuracy"]
        row = {"tag": tag, "step": lrn.step, "accuracy": acc, "time": time.time(), **summary}
        self.extras = {k: v for k, v in summary.items() if k != "eval/accuracy"}
        if self.exact is not None:
            probs = self.exact.action_probs(lrn.policy_params, lrn.mesh, lrn.rules)
            row["expected_reward"] = float(self.exact.exact.value(probs))
            # per decision point (the task's order): which decision is wrong, and when
            row["action_probs"] = [{a: round(q, 5) for a, q in p.items()} for p in probs]
            row["optimum"] = self.exact.optimum
            row.update(self.exact.policy_stats(lrn.policy_params, lrn.mesh, lrn.rules))
            self.extras = {
                **self.extras,
                "eval/expected_reward": row["expected_reward"],
                "eval/optimum_reward": row["optimum"],
                **{k: v for k, v in row.items() if k.startswith("eval/")},
            }
            logging.info(
                "exact expected reward %.4f (optimum %.4f) at step %d",
                row["expected_reward"],
                row["optimum"],
                row["step"],
            )
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        logging.info(
            "held-out accuracy %.3f at step %d (%s, %.2fs)",
            acc,
            row["step"],
            tag,
            time.perf_counter() - t0,
        )
        return acc

    def ensure(self, tag: str) -> dict:
        """The row recorded under `tag`, measured now if there is none yet."""
        if tag not in self.by_tag():
            self.run(tag)
        return self.by_tag()[tag]

    def maybe(self) -> float | None:
        """Evaluate on the schedule: every `period` RL steps (0 = never) and at the end."""
        step = self.learner.step
        done = step >= self.end
        if not done and not (self.period and (step - self.rl_start) % self.period == 0):
            return None
        return self.run("after" if done else "rl")

    def final(self) -> None:
        """The closing evaluation, unless this step already has it (or no RL step ran)."""
        step = self.learner.step
        tag = "after" if step >= self.end else "stop"
        if step > self.rl_start and self.by_tag().get(tag, {}).get("step") != step:
            self.run(tag)
