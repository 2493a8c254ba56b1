"""What a training binary's workdir says about its exact check (no absl flags here: tests
import it beside modules that define their own).

    consumed, quarantined = learner_record(workdir)   # train.log: the learner's verdicts
    checked = every_check(workdir)                     # ... every run's, reruns included
    rows = metrics_rows(workdir)                      # metrics.jsonl
"""

from __future__ import annotations

import json
import os
import re

STEP_LINE = re.compile(r"exact check step (\d+): groups (\{.*?\}) refused \[([\d, ]*)\]")
QUARANTINE_LINE = re.compile(r"quarantined worker (\S+):")


def learner_record(workdir: str):
    """[(step, group id, worker id, refused)] of every consumed group, in the order the
    learner checked them, and {quarantined worker id: the step whose audit did it}. (A group
    dropped at a quarantine goes back to the queue under its id: the worker tells whose
    copy a step consumed.)"""
    rows, quarantined, pending = {}, {}, []
    path = os.path.join(workdir, "train.log")
    if not os.path.exists(path):
        return [], {}
    with open(path, errors="replace") as f:
        for line in f:
            if m := STEP_LINE.search(line):
                quarantined.update((w, int(m[1])) for w in pending)  # this batch's audit
                pending = []
                refused = {int(x) for x in m[3].replace(",", " ").split()}
                made = json.loads(m[2]).items()
                rows[int(m[1])] = [(int(m[1]), int(k), w, int(k) in refused) for k, w in made]
            if m := QUARANTINE_LINE.search(line):
                pending.append(m[1])
    after = max(rows, default=-1) + 1  # quarantined after the last checked step
    quarantined.update((w, after) for w in pending)
    return [r for s in sorted(rows) for r in rows[s]], quarantined


def every_check(workdir: str) -> list[tuple[int, int, str, bool]]:
    """[(step, group id, worker id, refused)] of every group any binary run checked, in log
    order: a rerun that consumes a step again adds its lines beside the earlier run's
    (`learner_record` keeps the last), so a group an earlier run trained on stays in it
    even where a kill -9 rolled that update back."""
    path = os.path.join(workdir, "train.log")
    if not os.path.exists(path):
        return []
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            if m := STEP_LINE.search(line):
                refused = {int(x) for x in m[3].replace(",", " ").split()}
                out += [(int(m[1]), int(k), w, int(k) in refused)
                        for k, w in json.loads(m[2]).items()]  # fmt: skip
    return out


def metrics_rows(workdir: str) -> list[dict]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]
