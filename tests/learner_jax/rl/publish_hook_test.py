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
