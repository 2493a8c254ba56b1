"""ControllerDB's stale-buffer query (every lease asks it): skipped while every buffered
group is known fresh, and never skipped past a stale group buffered since, a rolled-back
requeue or groups put back by a rollback."""

import pytest

from bridge.control.state.db import ControllerDB


@pytest.fixture
def db(tmp_path):
    store = ControllerDB(str(tmp_path / "c.db"))
    with store.tx():
        store.add_groups([(f"p{i}", f"{i}+{i}=", str(2 * i)) for i in range(4)])
    yield store
    store.close()


def ids(db):
    return [r["group_id"] for r in db.groups_in("queued")]


def test_a_stale_group_buffered_after_a_clean_check_is_found(db):
    g = ids(db)
    with db.tx():
        db.buffer_group(g[0], "[]", 5, 0.0)
        assert db.stale_buffered(3) == []  # every buffered group is fresh from 3 on
        assert db.stale_buffered(2) == []
        db.buffer_group(g[1], "[]", 1, 0.0)  # a late submission, stale already
        assert db.stale_buffered(3) == [g[1]]
        db.requeue([g[1]])
        assert db.stale_buffered(3) == []
        assert db.stale_buffered(6) == [g[0]]  # the learner moved on


def test_a_rolled_back_requeue_leaves_the_stale_group_found(db):
    g = ids(db)
    with db.tx():
        db.buffer_group(g[0], "[]", 1, 0.0)
    with pytest.raises(RuntimeError), db.tx():
        assert db.stale_buffered(3) == [g[0]]
        db.requeue([g[0]])
        raise RuntimeError("the operation failed after the requeue")
    with db.tx():
        assert db.stale_buffered(3) == [g[0]]


def test_groups_put_back_in_the_buffer_are_checked_again(db):
    g = ids(db)
    with db.tx():
        db.buffer_group(g[0], "[]", 1, 0.0)
        db.set_state([g[0]], "consumed", consumed_step=0)
        assert db.stale_buffered(3) == []
        assert db.revert_consumed_after(-1) == 1  # a restore: consumed -> buffered
        assert db.stale_buffered(3) == [g[0]]
