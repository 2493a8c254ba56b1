"""hooks.Publish tells the controller which update windows held an XLA compile (cold), so a
one-off compile does not become the learner's overhead per update in the capacity model."""

import time
import types

import jax
import jax.numpy as jnp

from bridge.control.config import ControllerConfig
from bridge.control.controller import Controller
from bridge.control.protocol import SamplingParams
from bridge.tasks import make_task
from learner_jax.rl import hooks


class NotAPublishingStep:
    """What weights.Publisher.after_step returns when kappa skips a step (the subject here is
    the report after it, not publishing)."""

    def after_step(self, rl_steps: int) -> dict:
        return {"bridge/publish_s": 0.0}


def test_a_window_with_a_compile_is_reported_cold(tmp_path):
    ctl = Controller(
        ControllerConfig(staleness=2, groups_per_step=2, group_size=2, vocab_size=100,
                         sampling=SamplingParams(max_tokens=4)),
        str(tmp_path / "ctl.db"),
        make_task("arithmetic"),
    )  # fmt: skip
    hook = hooks.Publish(NotAPublishingStep(), ctl)
    step = {"time/step_s": 0.01, "time/data_wait_s": 0.0}
    try:
        for k in range(1, 6):  # warm windows: the learner's own time is ~nothing
            hook.after_step(types.SimpleNamespace(rl_steps=k), step)
        # A compile in the next window, and 2 s of the learner's own time with it: taken as
        # warm, the mean overhead over 5 reports would be at least 0.4 s.
        jax.jit(lambda x: x * 7.0 - 3.0)(jnp.ones(5)).block_until_ready()
        time.sleep(2.0)
        hook.after_step(types.SimpleNamespace(rl_steps=6), step)
        assert ctl.stats()["capacity/learner_overhead_s"] < 0.2
    finally:
        ctl.close()


def test_the_steps_staleness_kl_reaches_auto_s_and_moves_it(tmp_path):
    from controller_helpers import make, submit_all, worker

    from bridge.control.protocol import LeaseRequest

    ctl = make(
        tmp_path, staleness=1, staleness_auto=True, staleness_min=0, staleness_max=2,
        staleness_kl_max=0.01, groups_per_step=1, max_groups_per_lease=1,
    )  # fmt: skip
    hook = hooks.Publish(NotAPublishingStep(), ctl)
    ctl.publish(0)
    w = worker(ctl)
    try:
        for step in (1, 2):
            lease = ctl.lease(w, LeaseRequest(worker_version=step - 1, max_groups=1)).lease
            ctl.publish(step)
            submit_all(ctl, w, lease, versions=(step - 1,) * 3)  # lag 1
            batch, stats = ctl.wait_batch(step, 1, timeout_s=5.0)
            assert batch is not None
            # The first step's KL is past the ceiling: the second batch steps S down.
            assert stats["staleness/bound"] == (1 if step == 1 else 0)
            metrics = {"time/step_s": 0.01, "time/data_wait_s": 0.0, "staleness/kl": 0.05}
            hook.after_step(types.SimpleNamespace(rl_steps=step), metrics)
    finally:
        ctl.close()
