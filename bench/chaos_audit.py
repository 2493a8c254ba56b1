"""Independent audit of a chaos soak (bench/chaos.py), from the bench's own observations of
`controller.db`, its event log, the workers' logs and metrics.jsonl; never from the
controller's counters.

Definitions:
- Final lineage: for each learner step, the batch consumed by the last binary run that
  consumed that step (a rerun after kill -9 resumes from its checkpoint and consumes the
  steps after it again; those earlier consumptions are not in the lineage).
- Exactly once: every lineage step holds `groups_per_step` distinct groups, no group is in
  two lineage steps, and a group consumed by an earlier run and again by a later one was
  consumed, the first time, after the checkpoint the later run resumed from.
- No loss: every group observed accepted (buffered) is, at the end, in the lineage, still
  buffered, or went back to the queue when the learner's next step was more than S past its
  version (dropped as stale) or its worker was quarantined; a group observed consumed that
  vanished from the database must be in the lineage.
- No corrupt version served: no worker's log says "now serving version V" for the
  corrupted V after the corruption, the controller never recorded a worker at V in that
  time, and a worker log shows the refusal ("could not load version V"). The time ends when
  a rerun that resumed from a checkpoint before V starts (it deletes V and publishes a
  clean version with the same number), or when the learner heals V (its log says it
  publishes V again: learner_jax/rl/heal.py, or finds V corrupt and writes it again:
  learner_jax/rl/weights.py); a healed copy still in the store must read back verified.
- Every corrupt version healed (`corrupt_healed`): after its corruption each corrupted V
  is published again by the learner (its log), replaced by a rerun resumed from a
  checkpoint before V, or superseded: a worker serves a newer version, so the fleet moved
  past V. A V for which none of these happened held the run up to its end.
- No stall longer than B: bench/chaos_stall.py.
- Staleness: metrics `staleness/max` <= S on every line, and step - version <= S for every
  observed consumption.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import re

from bridge.store.layout import LAYOUT
from bridge.store.manifest import CorruptVersionError
from bridge.store.weight_store import WeightStore


def batches(obs, run_starts: list[float]) -> list[dict]:
    """Every observed consumption, from the groups' histories: the controller marks a
    batch's groups consumed in one transaction, so one batch = the groups first seen
    consumed at `step` in the same poll. `run` = the binary run live at that poll."""
    out: dict[tuple, dict] = {}
    for gid, h in obs.history.items():
        prev = None
        for t, state, mv, step, _ in h:
            if state == "consumed" and (prev is None or prev[:2] != (state, step)):
                run = max((i for i, t0 in enumerate(run_starts) if t0 <= t), default=0)
                b = out.setdefault((gid[0], step, t), {"t": t, "step": step, "run": run})
                b.setdefault("groups", set()).add(gid)
                b.setdefault("versions", []).append(mv)
            prev = (state, step)
    return sorted(out.values(), key=lambda b: b["t"])


def lineage(bs: list[dict]) -> dict[int, set]:
    """Step -> the groups of the last batch consumed for that step."""
    final = {}
    for b in bs:  # in time order: a later consumption of a step replaces an earlier one
        final[b["step"]] = b["groups"]
    return dict(sorted(final.items()))


def _absl_time(line: str, day: datetime.date) -> float | None:
    m = re.match(r"[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d+)", line)
    if not m:
        return None
    mo, d, hh, mi, ss = m.groups()
    dt = datetime.datetime(day.year, int(mo), int(d), int(hh), int(mi), tzinfo=datetime.UTC)
    return dt.timestamp() + float(ss)


def heal_times(workdir: str, version: int, day: datetime.date) -> list[float]:
    """When the learner's log says it wrote `version` again (healed it)."""
    path = os.path.join(workdir, "train.log")
    if not os.path.exists(path):
        return []
    marks = (f"publishing version {version} again", f"version {version} in ")
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            if any(m in line for m in marks) and ("again" in line):
                t = _absl_time(line, day)
                if t is not None:
                    out.append(t)
    return out


def healed_copy_error(workdir: str, version: int) -> str | None:
    """None if the store's copy of `version` (if still there) reads back verified."""
    store = WeightStore(os.path.join(workdir, "weights"))
    if version not in store.versions():
        return None
    try:
        store.read_all(version)
    except CorruptVersionError as e:
        return str(e)[:300]
    return None


def serving_times(worker_logs: str, day: datetime.date) -> list[tuple[float, int]]:
    """(time, version) of every "now serving version V" line in the workers' logs."""
    out = []
    for path in sorted(glob.glob(os.path.join(worker_logs, "*.log"))):
        with open(path, errors="replace") as f:
            for line in f:
                m = re.search(r"now serving version (\d+) ", line)
                if m and (t := _absl_time(line, day)) is not None:
                    out.append((t, int(m.group(1))))
    return out


def reruns_in_train_log(workdir: str, day: datetime.date) -> list[tuple[float, int]]:
    """(time, resumed step) of each binary run after the first, from the learner's log: the
    `reruns` of `corrupt_outcomes` for a soak audited again from its workdir."""
    out = []
    with open(os.path.join(workdir, "train.log"), errors="replace") as f:
        for line in f:
            m = re.search(r"resumed from step (\d+)", line)
            if m and (t := _absl_time(line, day)) is not None:
                out.append((t, int(m.group(1))))
    return out[1:]


def corrupt_outcomes(
    corrupt: list[dict], workdir: str, worker_logs: str, reruns: list[tuple[float, int]]
) -> dict:
    """The `corrupt_healed` check: per corrupted version (records with `version` and `at`),
    how it stopped mattering (module docstring). `reruns`: (start time, resumed step) of
    each binary run after the first."""
    outcomes = {}
    for rec in corrupt:
        v, at = rec["version"], rec["at"]
        day = datetime.datetime.fromtimestamp(at, datetime.UTC).date()
        heals = [t for t in heal_times(workdir, v, day) if t >= at - 1]
        rerun = [t for t, step in reruns if step < v and t >= at]
        newer = [(t, w) for t, w in serving_times(worker_logs, day) if w > v and t >= at]
        if heals:
            outcomes[v] = f"published again after {min(heals) - at:.0f} s"
        elif rerun:
            outcomes[v] = f"replaced by a rerun after {min(rerun) - at:.0f} s"
        elif newer:
            t, w = min(newer)
            outcomes[v] = f"superseded: a worker served version {w} after {t - at:.0f} s"
        else:
            outcomes[v] = "unhealed"
    return {
        "ok": "unhealed" not in outcomes.values(),
        "outcomes": {str(v): o for v, o in sorted(outcomes.items())},
    }


def audit(
    obs,
    workdir: str,
    worker_logs: str,
    staleness: int,
    groups_per_step: int,
    resumes: dict[int, int],
    corrupt: list[dict] | None,
    hostile_workers: set[str],
    run_starts: list[float],
    forgers: frozenset[str] | set[str] = frozenset(),
) -> dict:
    """`resumes`: run index -> the step its checkpoint resumed from (runs after the first).
    `forgers`: hostile workers (bench/chaos_hostile.py) whose work may be accepted until
    the audit quarantines them, and whose claimed versions serve nothing."""
    checks: dict[str, dict] = {}
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    # A metrics line's step counts the update it logs: it consumed the batch of step - 1.
    # Steps an earlier run consumed beyond where the final run stopped are not in the lineage.
    end = rows[-1]["step"] if rows else 0
    bs = batches(obs, run_starts)
    lin = {s: g for s, g in lineage(bs).items() if s < end}

    # 1. Exactly once.
    bad_size = {s: len(g) for s, g in lin.items() if len(g) != groups_per_step}
    where: dict[int, int] = {}
    dupes = []
    for s, gids in lin.items():
        for g in gids:
            if g in where:
                dupes.append((g, where[g], s))
            where[g] = s
    early = []  # re-consumed although the first consumption was checkpointed
    first: dict = {}
    for b in bs:
        for g in b["groups"]:
            if g in first and first[g][0] < b["run"]:
                r0, s0 = first[g]
                back = min((resumes[r] for r in resumes if r0 < r <= b["run"]), default=None)
                if back is None or s0 < back:
                    early.append({"group": g, "first": [r0, s0], "again": [b["run"], b["step"]]})
            first.setdefault(g, (b["run"], b["step"]))
    steps = sorted(lin)
    gaps = [s for s in range(steps[0], steps[-1] + 1) if s not in lin] if steps else []
    checks["exactly_once"] = {
        "ok": not (bad_size or dupes or early or gaps),
        "lineage_steps": len(lin),
        "first_step": steps[0] if steps else None,
        "last_step": steps[-1] if steps else None,
        "unobserved_steps": gaps,
        "wrong_batch_size": bad_size,
        "in_two_steps": dupes[:10],
        "reconsumed_before_checkpoint": early[:10],
        "reconsumptions_after_restarts": sum(len(b["groups"]) for b in bs)
        - sum(len(g) for g in lin.values()),
    }

    # 2. No accepted trajectory lost.
    in_lineage = set(where)
    lost, dropped_stale, dropped_quarantined, requeued_other = [], 0, 0, []
    crash_dead_lineage = 0  # discarded with a moved-aside database, versions past the resume
    for gid, h in obs.history.items():
        ever_buffered = [e for e in h if e[1] == "buffered"]
        ever_consumed = any(e[1] == "consumed" for e in h)
        if not ever_buffered and not ever_consumed:
            continue
        epoch = gid[0]
        if epoch != obs.epoch:  # its database was moved aside by a rerun
            final_state = "discarded"
        else:
            final_state = h[-1][1] if gid in obs.present else "deleted"
        if gid in in_lineage or final_state in ("buffered", "consumed"):
            continue
        mv = h[-1][2]
        if final_state == "discarded" and h[-1][1] in ("buffered", "consumed"):
            back = resumes.get(obs.epoch_run.get(epoch + 1, -1))
            if back is not None and mv is not None and mv > back:
                crash_dead_lineage += 1  # made by a version the rerun rolled back: invalid
            else:
                lost.append(
                    {
                        "group": gid,
                        "why": f"discarded on rerun (resumed {back})",
                        "history": [e[1:4] for e in h],
                    }
                )
            continue
        if final_state in ("deleted", "discarded"):
            lost.append({"group": gid, "why": final_state, "history": [e[1:4] for e in h]})
            continue
        # Back in the queue (or leased again): legitimate only as a stale drop.
        mv = ever_buffered[-1][2] if ever_buffered else None
        lease = ever_buffered[-1][4] if ever_buffered else None
        if mv is not None and obs.next_step_max - mv > staleness:
            dropped_stale += 1
        elif (epoch, obs.lease_worker.get(lease)) in getattr(obs, "quarantined", set()):
            dropped_quarantined += 1
        else:
            requeued_other.append({"group": gid, "history": [e[1:4] for e in h]})
    checks["no_loss"] = {
        "ok": not lost and not requeued_other,
        "groups_accepted_observed": sum(
            1 for h in obs.history.values() if any(e[1] in ("buffered", "consumed") for e in h)
        ),
        "in_lineage": len(in_lineage),
        "still_buffered": sum(1 for g in obs.present if obs.history[g][-1][1] == "buffered"),
        "dropped_stale": dropped_stale,
        "dropped_quarantined": dropped_quarantined,
        "discarded_from_rolled_back_versions": crash_dead_lineage,
        "lost_count": len(lost),
        "requeued_not_stale": requeued_other[:10],
        "lost": lost[:5],
    }

    # 3. No corrupt version served.
    c = {"ok": True, "corrupted_versions": []}
    corrupt = [r for r in corrupt or [] if r.get("version") is not None]
    if corrupt:
        served, refused, recorded, rewritten, healed = [], [], [], [], []
        for rec in corrupt:
            v, at = rec["version"], rec["at"]
            day = datetime.datetime.fromtimestamp(at, datetime.UTC).date()
            manifest = os.path.join(workdir, "weights", LAYOUT.manifest_key(v))
            # A rerun resumed from a checkpoint before v deleted v and publishes a clean
            # version with the same number (older runs moved the store aside instead,
            # weights.stale-TAG): serving v after that is serving the new one.
            reruns = [
                run_starts[r]
                for r, step in resumes.items()
                if step < v and r < len(run_starts) and run_starts[r] >= at
            ]
            # The manifest may change only by such a republish (a corrupt version rewritten
            # in place would be served as if it were clean).
            heals = [t for t in heal_times(workdir, v, day) if t >= at - 1]
            original = rec.get("manifest")
            if original and os.path.exists(manifest) and open(manifest, "rb").read() != original:
                if not reruns and not heals:
                    rewritten.append(v)
                elif heals and (err := healed_copy_error(workdir, v)) is not None:
                    rewritten.append(f"{v}: healed copy corrupt: {err}")
            if heals:
                healed.append(v)
            moved = [
                datetime.datetime.strptime(p.rsplit("stale-", 1)[1], "%Y%m%d-%H%M%S")
                .replace(tzinfo=datetime.UTC)
                .timestamp()
                for p in glob.glob(os.path.join(workdir, "weights.stale-*"))
            ]
            until = min([m for m in moved if m >= at - 1] + reruns + heals, default=float("inf"))
            for path in sorted(glob.glob(os.path.join(worker_logs, "*.log"))):
                with open(path, errors="replace") as f:
                    for line in f:
                        t = _absl_time(line, day)
                        if f"now serving version {v} " in line and t and at <= t < until:
                            served.append(f"{os.path.basename(path)}: {line.strip()[:200]}")
                        if f"could not load version {v}:" in line:
                            refused.append(f"{os.path.basename(path)}: {line.strip()[:300]}")
            recorded += [
                w
                for (e, w), vs in obs.worker_versions.items()
                if v in vs
                and e == rec.get("epoch", 0)
                and at <= vs[v] < until
                and w not in hostile_workers | set(forgers)  # a forger's claim serves nothing
            ]
        probes = [r.get("probe") or {} for r in corrupt]
        c = {
            # Every probe read refused; a worker refusal shows unless no worker tried (the
            # next version came first), and none served it.
            "ok": not served
            and not recorded
            and not rewritten
            and all(p.get("refused") for p in probes),
            "probe_refusals": sum(bool(p.get("refused")) for p in probes),
            "probe_example": probes[0].get("error"),
            "corrupted_versions": [r["version"] for r in corrupt],
            "chunks": [r["chunk"] for r in corrupt],
            "served_after_corruption": served[:5],
            "workers_recorded_at_version": sorted(set(recorded)),
            "refusals": len(refused),
            "refusal_example": refused[0] if refused else None,
            "manifest_rewritten_in_place": rewritten,
            "healed_versions": sorted(set(healed)),
        }
    checks["no_corrupt_version_served"] = c
    reruns = [(run_starts[r], step) for r, step in resumes.items() if r < len(run_starts)]
    checks["corrupt_healed"] = corrupt_outcomes(corrupt, workdir, worker_logs, reruns)

    # 4. Staleness <= S.
    rows = [r for r in rows if "staleness/max" in r]
    metric_max = max((r["staleness/max"] for r in rows), default=None)
    db_max = max((b["step"] - v for b in bs for v in b["versions"] if v is not None), default=None)
    checks["staleness"] = {
        "ok": (metric_max is None or metric_max <= staleness)
        and (db_max is None or db_max <= staleness),
        "S": staleness,
        "metrics_max": metric_max,
        "db_max_step_minus_version": db_max,
    }

    # 5. Garbage never accepted.
    hostile = {lid for lid, w in obs.lease_worker.items() if w in hostile_workers}
    accepted_hostile = [
        gid
        for gid, h in obs.history.items()
        if any(e[1] in ("buffered", "consumed") and e[4] in hostile for e in h)
    ]
    checks["garbage_rejected"] = {
        "ok": not accepted_hostile,
        "hostile_leases": len(hostile),
        "groups_accepted_from_hostile": accepted_hostile,
    }
    return {
        "ok": all(v["ok"] for v in checks.values()),
        "checks": checks,
        "observer_polls": obs.polls,
        "observer_errors": obs.errors,
    }
