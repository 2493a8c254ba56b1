"""`config.distributed` -> DistributedConfig: one process by default, bad combinations refused
before anything connects. (The multi-process runtime itself: multihost_test.py.)"""

import jax
import numpy as np
import pytest

from learner_jax import config_file, run_config
from learner_jax.multihost import distributed, mirror
from learner_jax.training import train_step


def test_unset_keys_mean_one_process_and_initialize_is_a_no_op():
    config = config_file.load_config("configs/tiny_arith.py")
    cfg = run_config.distributed_config(config)
    assert not cfg.enabled
    distributed.initialize(cfg)  # nothing to connect to: returns at once
    assert jax.process_count() == 1 and distributed.is_leader()
    distributed.barrier("one process: no-op")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(coordinator_address="h:1"), "go together"),
        (dict(coordinator_address="h:1", num_processes=2, process_id=2), "not in"),
        (dict(heartbeat_timeout_s=0), "heartbeat"),
    ],
)
def test_bad_combinations_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        distributed.DistributedConfig(**kwargs)


def test_auto_lets_jax_fill_in_the_rest():
    assert distributed.DistributedConfig(auto=True).enabled
    assert distributed.DistributedConfig(coordinator_address="h:1", auto=True).enabled


def test_a_step_message_carries_only_the_receivers_rows():
    rng = np.random.default_rng(0)
    batch = train_step.make_batch(
        rng.integers(3, 50, (8, 7)), np.ones((8, 7)), advantages=rng.standard_normal(8)
    )
    fields = {k: np.asarray(v) for k, v in vars(batch).items() if v is not None}
    rows = np.array([2, 3, 6, 7])
    arrays = {k: v[rows] for k, v in fields.items()}
    arrays["_rows"] = rows
    shapes = {k: list(v.shape) for k, v in fields.items()}
    data = mirror._encode({"cmd": "step", "shapes": shapes}, arrays)
    header, got = mirror._decode(data)
    assert all(len(v) == len(rows) for v in got.values())  # the message holds 4 of 8 rows
    out = mirror._global_batch(header, got)
    for name, full in fields.items():
        value = np.asarray(getattr(out, name))
        np.testing.assert_array_equal(value[rows], full[rows])
        assert not value[[0, 1, 4, 5]].any()  # rows of other processes are never sent
