"""bench/async_bias.py on real controllers (the runs themselves are the bench): the same slow
lease -- leased at version 0, its long samples continued to version 2 -- comes back to a
controller with `rollout.partial=off` and to one with `continue`. Off drops it (its oldest
token is too stale at S = 1), continue consumes it as a continued group; the bench's readers
(staleness_bias.read_cell, `continued_groups`) and its headline must say exactly that, and
the auto part's headline must pick each task's best fixed S by quality, then utilization."""

import pytest
from controller_helpers import make, result

from bench import async_bias, staleness_bias
from bridge.control.protocol import LeaseRequest, SamplingParams, Submission, WorkerProfile


def _worker(ctl, name):
    wid, _ = ctl.register(
        WorkerProfile(accelerator="cpu", price_per_hour=1.0, max_concurrent_sequences=64, name=name)
    )
    return wid


def _cell(tmp_path, partial):
    """Two groups: the fast worker's short one (2 tokens, version 2) and the slow worker's
    long one (6 tokens, versions 0, 0, 1, 2, 2, 2); the learner takes both at step 3, S = 1."""
    tmp_path.mkdir()
    ctl = make(
        tmp_path, staleness=1, groups_per_step=1, max_groups_per_lease=1, partial=partial,
        sampling=SamplingParams(max_tokens=8),
    )  # fmt: skip
    slow, fast = _worker(ctl, "pool-b-1"), _worker(ctl, "pool-a-0")
    ctl.publish(0)
    late = ctl.lease(slow, LeaseRequest(worker_version=0, max_groups=1)).lease
    ctl.publish(1)
    ctl.publish(2)
    lease = ctl.lease(fast, LeaseRequest(worker_version=2, max_groups=1)).lease
    groups = [result(g, versions=(2, 2)) for g in lease.groups]
    ctl.submit(fast, Submission(lease_id=lease.lease_id, groups=groups))
    groups = [result(g, versions=(0, 0, 1, 2, 2, 2)) for g in late.groups]
    ctl.submit(slow, Submission(lease_id=late.lease_id, groups=groups))
    if ctl.take_batch(3, 2)[0] is None:  # one was dropped: the learner takes the other
        assert ctl.take_batch(3, 1)[0] is not None
    ctl.close()
    db = str(tmp_path / "ctl.db")
    cell = {"task": "demo", "S": 1, "partial": partial, "wall_s": 1.0}
    cell.update(staleness_bias.read_cell(db, "demo", "pool-b-"))
    cell["headline"] = staleness_bias.headline_of(cell)
    cell["continued_groups"], consumed, cell["token_lag"] = async_bias.continued_groups(db)
    return cell, consumed


def test_off_drops_the_long_continued_group_and_continue_trains_it(tmp_path):
    off, consumed_off = _cell(tmp_path / "off", "off")
    on, consumed_on = _cell(tmp_path / "on", "continue")
    assert (off["consumed"]["groups"], off["dropped"]["groups"], off["continued_groups"]) == (
        1, 1, 0,
    )  # fmt: skip
    assert (on["consumed"]["groups"], on["dropped"]["groups"], on["continued_groups"]) == (2, 0, 1)
    # Token lag at step 3: the fast group's 2 tokens of version 2 (lag 1 each), with
    # `continue` also the slow one's 0, 0, 1, 2, 2, 2 (3, 3, 2, 1, 1, 1): 13 / 8.
    assert off["token_lag"] == pytest.approx(1.0)
    assert on["token_lag"] == pytest.approx(13 / 8)
    auto = [
        {"task": task, "S": s, "quality_final": q, "quality_before": 0.1,
         "learner_utilization": u, "staleness_mean": 0.0, "staleness_max": 0, "rl_wall_s": 1.0}
        for task, s, q, u in (
            ("demo", 0, 0.8, 0.2), ("demo", 2, 0.8, 0.7), ("demo", 4, 0.6, 0.75),
            ("demo", "auto", 0.75, 0.8), ("kuhn", 1, -0.12, 0.4), ("kuhn", 2, -0.11, 0.6),
            ("kuhn", "auto", -0.10, 0.5),
            # auto without its KL ceiling (--auto_no_kl): neither a fixed S nor auto's cell
            ("demo", "auto_nokl", 0.95, 0.95),
        )
    ]  # fmt: skip
    head = async_bias.headline_of([off, on], auto)
    assert head["dropped_frac_off"] == pytest.approx(0.5)
    assert head["length_bias_off"] == pytest.approx(6 / 2)  # dropped 6 tokens, consumed 2
    assert head["dropped_frac_continue"] == 0.0 and head["length_bias_continue"] is None
    assert head["token_lag_continue"] == pytest.approx(13 / 8) and "token_lag_off" not in head
    assert head["best_fixed_S_demo"] == 2  # quality tie with S = 0: the higher utilization
    assert head["auto_quality_minus_best_fixed_demo"] == pytest.approx(0.75 - 0.8)
    assert head["auto_util_minus_best_fixed_demo"] == pytest.approx(0.8 - 0.7)
    assert head["best_fixed_S_kuhn"] == 2  # each task is judged against its own fixed S
    assert head["auto_quality_minus_best_fixed_kuhn"] == pytest.approx(-0.10 + 0.11)
    assert head["auto_util_minus_best_fixed_kuhn"] == pytest.approx(0.5 - 0.6)
    # the plain keys are the worse task's: auto must hold on each task
    assert head["auto_quality_minus_best_fixed"] == pytest.approx(0.75 - 0.8)
    assert head["auto_util_minus_best_fixed"] == pytest.approx(0.5 - 0.6)
    table = async_bias.markdown(async_bias.rows_of([off, on], auto))
    assert "| demo | 1 | continue | 2 / 0 | 1 | 1.62 |" in table


def test_the_throttle_follows_the_learner_step_without_its_waits():
    """`learner_step_s`: per step the wall time since the previous step less the learner's
    wait for data, the median over the steps after the first two (compiling; its wall
    time). Steps of 10 s each with waits of 0-30 s between them: 10 s, whatever the waits."""
    waits = [50.0, 40.0, 0.0, 30.0, 5.0, 0.0]  # the first two are the compile's, skipped
    rows, wall = [], 1000.0
    for w in waits:
        wall += w + 10.0
        rows.append({"time/wall": wall, "time/wait_s": w, "time/step_s": 4.0})
    assert async_bias.learner_step_s(rows) == pytest.approx(10.0)
    rows[3]["time/wall"] += 7.0  # one slow step (7 s of overhead): the median holds
    rows[4]["time/wall"] += 7.0
    rows[5]["time/wall"] += 7.0
    assert async_bias.learner_step_s(rows) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="at least 3"):
        async_bias.learner_step_s(rows[:2])
