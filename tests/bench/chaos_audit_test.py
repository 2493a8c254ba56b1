"""The chaos soak's audit (bench/chaos_audit.py) can fail: fed a synthetic observation of a
clean run it passes, and each fault it claims to catch (a lost group, a group trained on
twice, a step with the wrong batch, a group re-consumed although its first consumption was
checkpointed, a batch more than S stale, a corrupt version served or never healed, a
forged submission accepted) makes exactly the check that names it fail.
tests/chaos_test.py trusts the audit; this file is why it may.

The observation has the shape of bench/chaos_faults.py's `Observer`: per group (epoch, id)
a history of (t, state, min_version, consumed_step, lease_id), one entry per change seen.
"""

import copy
import datetime
import json
import types

from bench import chaos_audit

S = 2
GROUPS_PER_STEP = 2
STEPS = 4  # lineage steps 0..3; metrics lines for steps 1..4 (a line's step counts updates)
T0 = 1_800_000_000.0


def group_history(step: int, version: int, lease: str = "L0") -> list[tuple]:
    """Queued, leased, accepted at `version`, consumed at `step` (in the poll at T0 + step:
    a batch's groups are marked consumed in one transaction, so one poll sees them all)."""
    t = T0 + step - 0.5
    return [
        (t, "queued", None, None, None),
        (t + 0.1, "leased", None, None, lease),
        (t + 0.2, "buffered", version, None, lease),
        (T0 + step, "consumed", version, step, lease),
    ]


def clean_observation() -> types.SimpleNamespace:
    history = {}
    for step in range(STEPS):
        for j in range(GROUPS_PER_STEP):
            history[(0, 1 + step * GROUPS_PER_STEP + j)] = group_history(step, version=step)
    last = 1 + STEPS * GROUPS_PER_STEP
    history[(0, last)] = group_history(STEPS, version=STEPS)[:3]  # accepted, still buffered
    return types.SimpleNamespace(
        history=history,
        present=set(history),
        epoch=0,
        epoch_run={0: 0},
        next_step_max=STEPS,
        worker_versions={(0, "w0"): {v: T0 + v for v in range(STEPS + 1)}},
        lease_worker={"L0": "w0", "L-forged": "hostile-0"},
        polls=100,
        errors=0,
    )


def run_audit(tmp_path, obs, metrics=None, logs=(), corrupt=None, resumes=None, starts=None):
    workdir = tmp_path / "run"
    (workdir / "weights").mkdir(parents=True, exist_ok=True)
    metrics = metrics or [{"step": s, "staleness/max": 0} for s in range(1, STEPS + 1)]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    log_dir = tmp_path / "logs"
    log_dir.mkdir(exist_ok=True)
    (log_dir / "w0.log").write_text("".join(line + "\n" for line in logs))
    return chaos_audit.audit(
        obs,
        str(workdir),
        str(log_dir),
        staleness=S,
        groups_per_step=GROUPS_PER_STEP,
        resumes=resumes or {},
        corrupt=corrupt,
        hostile_workers={"hostile-0"},
        run_starts=starts or [T0 - 10],
    )


def failed(report) -> set[str]:
    return {name for name, check in report["checks"].items() if not check["ok"]}


def test_clean_observation_passes(tmp_path):
    report = run_audit(tmp_path, clean_observation())
    assert report["ok"], report
    assert report["checks"]["exactly_once"]["lineage_steps"] == STEPS
    assert report["checks"]["no_loss"]["still_buffered"] == 1


def test_a_lost_group_fails_no_loss(tmp_path):
    obs = clean_observation()
    gid = (0, 1 + STEPS * GROUPS_PER_STEP)  # the buffered one vanishes from the database
    obs.present.discard(gid)
    report = run_audit(tmp_path, obs)
    assert failed(report) == {"no_loss"}
    assert report["checks"]["no_loss"]["lost_count"] == 1


def test_a_group_in_two_steps_fails_exactly_once(tmp_path):
    obs = clean_observation()
    # Step 2 trains on group 1 again (consumed at step 0) instead of its own group 5.
    obs.history[(0, 5)] = obs.history[(0, 5)][:3]  # stays buffered: no loss, no gap
    obs.history[(0, 1)] = obs.history[(0, 1)] + [(T0 + 2, "consumed", 0, 2, "L0")]
    report = run_audit(tmp_path, obs)
    assert "exactly_once" in failed(report)
    assert report["checks"]["exactly_once"]["in_two_steps"] == [((0, 1), 0, 2)]


def test_a_short_batch_fails_exactly_once(tmp_path):
    obs = clean_observation()
    obs.history[(0, 3)] = obs.history[(0, 3)][:3]  # step 1 took one group, not two
    report = run_audit(tmp_path, obs)
    assert failed(report) == {"exactly_once"}
    assert report["checks"]["exactly_once"]["wrong_batch_size"] == {1: 1}


def test_a_missing_step_fails_exactly_once(tmp_path):
    obs = clean_observation()
    for gid in ((0, 5), (0, 6)):  # step 2's batch never observed consumed
        obs.history[gid] = obs.history[gid][:3]
    report = run_audit(tmp_path, obs)
    assert failed(report) == {"exactly_once"}
    assert report["checks"]["exactly_once"]["unobserved_steps"] == [2]


def test_reconsumed_after_its_checkpoint_fails_exactly_once(tmp_path):
    """Run 0 consumed step 3; run 1 resumed from the checkpoint at step 4, which already
    holds step 3's update, and trained on step 3's groups again."""
    obs = clean_observation()
    for gid in ((0, 7), (0, 8)):
        obs.history[gid] = obs.history[gid] + [
            (T0 + 20, "buffered", 3, None, "L0"),
            (T0 + 21, "consumed", 3, 3, "L0"),
        ]
    starts = [T0 - 10, T0 + 10]
    ok = run_audit(tmp_path, copy.deepcopy(obs), resumes={1: 3}, starts=starts)
    assert ok["ok"], ok  # resumed from 3: step 3 is legitimately trained again
    report = run_audit(tmp_path, obs, resumes={1: 4}, starts=starts)
    assert failed(report) == {"exactly_once"}
    assert len(report["checks"]["exactly_once"]["reconsumed_before_checkpoint"]) == 2


def test_an_over_stale_batch_fails_staleness(tmp_path):
    obs = clean_observation()
    for gid in ((0, 7), (0, 8)):  # step 3 trained on version 0: 3 > S behind
        obs.history[gid] = group_history(3, version=3 - S - 1)
    report = run_audit(tmp_path, obs)
    assert failed(report) == {"staleness"}
    assert report["checks"]["staleness"]["db_max_step_minus_version"] == S + 1
    # The learner's own metric is read too.
    metrics = [{"step": s, "staleness/max": S + 1 if s == 2 else 0} for s in range(1, STEPS + 1)]
    assert failed(run_audit(tmp_path, clean_observation(), metrics=metrics)) == {"staleness"}


def test_a_forged_submission_accepted_fails_garbage_rejected(tmp_path):
    obs = clean_observation()
    gid = (0, 1 + STEPS * GROUPS_PER_STEP)
    obs.history[gid] = group_history(STEPS, version=STEPS, lease="L-forged")[:3]
    report = run_audit(tmp_path, obs)
    assert failed(report) == {"garbage_rejected"}


def absl(t, msg):
    d = datetime.datetime.fromtimestamp(t, datetime.UTC)
    return f"I{d:%m%d %H:%M:%S}.{d.microsecond:06d} 1 worker.py:1] {msg}"


def test_a_corrupt_version_served_fails(tmp_path):
    v, at = 2, T0 + 1.5  # version 2 corrupted before any worker swapped to it
    probe = {"refused": True, "error": "checksum mismatch"}
    corrupt = [{"version": v, "at": at, "chunk": "x/c/0", "epoch": 0, "probe": probe}]
    refused = [
        absl(at + 1, f"could not load version {v}: checksum mismatch"),
        absl(at + 5, f"now serving version {v + 1} (fetched)"),  # the fleet moved past v
    ]
    obs = clean_observation()
    obs.worker_versions = {(0, "w0"): {0: T0, 1: T0 + 1}}  # never at v
    report = run_audit(tmp_path, obs, logs=refused, corrupt=corrupt)
    assert report["ok"], report
    assert report["checks"]["no_corrupt_version_served"]["refusals"] == 1

    served = refused + [absl(at + 2, f"now serving version {v} (fetched)")]
    report = run_audit(tmp_path, obs, logs=served, corrupt=corrupt)
    assert failed(report) == {"no_corrupt_version_served"}
    obs.worker_versions[(0, "w0")][v] = at + 3  # the controller saw a worker at v
    report = run_audit(tmp_path, obs, logs=refused, corrupt=corrupt)
    assert failed(report) == {"no_corrupt_version_served"}
    assert report["checks"]["no_corrupt_version_served"]["workers_recorded_at_version"] == ["w0"]
    del obs.worker_versions[(0, "w0")][v]
    probe["refused"] = False  # the verified reader took the corrupted chunk
    report = run_audit(tmp_path, obs, logs=refused, corrupt=corrupt)
    assert failed(report) == {"no_corrupt_version_served"}


def test_a_corrupt_version_never_healed_fails(tmp_path):
    """Refused and never served, but nothing moved past it: no re-publish, no rerun, no
    worker on a newer version. Each of those three heals it."""
    v, at = 2, T0 + 1.5
    probe = {"refused": True, "error": "checksum mismatch"}
    corrupt = [{"version": v, "at": at, "chunk": "x/c/0", "epoch": 0, "probe": probe}]
    refused = [absl(at + 1, f"could not load version {v}: checksum mismatch")]
    obs = clean_observation()
    obs.worker_versions = {(0, "w0"): {0: T0, 1: T0 + 1}}
    report = run_audit(tmp_path, obs, logs=refused, corrupt=corrupt)
    assert failed(report) == {"corrupt_healed"}
    assert report["checks"]["corrupt_healed"]["outcomes"] == {str(v): "unhealed"}
    # A worker serving v itself, or an older version, after the corruption heals nothing.
    old = refused + [absl(at + 3, f"now serving version {v - 1} (fetched)")]
    assert "corrupt_healed" in failed(run_audit(tmp_path, obs, logs=old, corrupt=corrupt))

    newer = refused + [absl(at + 4, f"now serving version {v + 1} (fetched)")]
    report = run_audit(tmp_path, obs, logs=newer, corrupt=corrupt)
    assert report["ok"], report
    assert report["checks"]["corrupt_healed"]["outcomes"][str(v)].startswith("superseded")

    rerun = run_audit(tmp_path, obs, logs=refused, corrupt=corrupt, resumes={1: 1},
                      starts=[T0 - 10, at + 20])  # fmt: skip
    assert rerun["checks"]["corrupt_healed"]["outcomes"][str(v)].startswith("replaced by")

    train_log = tmp_path / "run" / "train.log"
    train_log.write_text(absl(at + 7, f"workers cannot load version {v}: publishing version "
                                      f"{v} again from the learner") + "\n")  # fmt: skip
    report = run_audit(tmp_path, obs, logs=refused, corrupt=corrupt)
    assert report["ok"], report
    assert report["checks"]["corrupt_healed"]["outcomes"][str(v)] == "published again after 7 s"


def test_an_accepted_group_requeued_while_fresh_fails_no_loss(tmp_path):
    obs = clean_observation()
    gid = (0, 1 + STEPS * GROUPS_PER_STEP)  # accepted at version 4, back in the queue at once
    obs.history[gid] = obs.history[gid] + [(T0 + 10, "queued", STEPS, None, None)]
    report = run_audit(tmp_path, obs)
    assert report["checks"]["no_loss"]["requeued_not_stale"]
    assert failed(report) == {"no_loss"}
    # Legitimate when its worker was quarantined (its accepted groups go back to the queue).
    lease = obs.history[gid][-2][4]
    obs.lease_worker[lease] = "w-bad"
    obs.quarantined = {(0, "w-bad")}
    report = run_audit(tmp_path, obs)
    assert report["ok"], report
    assert report["checks"]["no_loss"]["dropped_quarantined"] == 1
