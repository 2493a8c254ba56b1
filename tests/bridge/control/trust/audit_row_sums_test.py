"""The audit's per-row sums (bridge/control/audit.row_sums): one definition that numpy and
jax.numpy compute alike, that ignores what lies outside the mask, and that the per-worker
stats are built from."""

import jax.numpy as jnp
import numpy as np

from bridge.control.trust import audit


def _rows():
    rng = np.random.default_rng(0)
    learner = rng.normal(-2.0, 0.5, (3, 6))
    behaviour = learner + rng.normal(0.0, 0.1, (3, 6))
    mask = np.array([[1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]], np.float64)
    behaviour[mask == 0] = -np.inf  # padding may hold anything; it must not count
    return learner, behaviour, mask


def test_row_sums_by_hand_and_equal_under_numpy_and_jax():
    learner, behaviour, mask = _rows()
    k3_rows, lr_rows, n_rows = audit.row_sums(learner, behaviour, mask)
    for b in range(3):
        on = mask[b] > 0
        d = learner[b, on] - behaviour[b, on]
        np.testing.assert_allclose(k3_rows[b], np.sum(np.exp(d) - 1 - d), rtol=1e-12)
        np.testing.assert_allclose(lr_rows[b], np.sum(behaviour[b, on] - learner[b, on]))
        assert n_rows[b] == on.sum()
    as32 = lambda x: jnp.asarray(x, jnp.float32)
    got = audit.row_sums(as32(learner), as32(behaviour), as32(mask), xp=jnp)
    for want, have in zip((k3_rows, lr_rows, n_rows), got, strict=True):
        # float32 of O(1) values summed over <= 6 tokens: a few ulps of the row's scale.
        np.testing.assert_allclose(np.asarray(have), want, rtol=1e-5, atol=1e-6)


def test_worker_stats_are_the_row_sums_per_worker():
    learner, behaviour, mask = _rows()
    stats = audit.rows_to_worker_stats(
        ["a", "b", "a"], [4, 4, 4], behaviour, learner, mask, current_version=4
    )
    k3_rows, lr_rows, n_rows = audit.row_sums(learner, behaviour, mask)
    by = {s.worker_id: s for s in stats}
    assert set(by) == {"a", "b"}  # row 2 has no tokens: nothing to add for it
    assert by["a"].tokens == n_rows[0] and by["b"].tokens == n_rows[1]
    assert by["b"].sum_k3 == k3_rows[1] and by["b"].sum_logratio == lr_rows[1]
    stale = audit.rows_to_worker_stats(["a"], [3], behaviour[:1], learner[:1], mask[:1], 4)
    assert stale == []  # only rows sampled by the current version are compared here
