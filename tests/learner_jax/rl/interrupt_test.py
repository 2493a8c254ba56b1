"""Ctrl-C during RL: the first SIGINT asks to stop, a second one aborts, the old handler returns."""

import os
import signal

import pytest

from learner_jax.rl.interrupt import MESSAGE, StopOnCtrlC


def test_first_ctrl_c_requests_a_stop_second_aborts():
    before = signal.getsignal(signal.SIGINT)
    told = []
    with StopOnCtrlC(told.append) as stop:
        assert not stop.requested()
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested() and told == [MESSAGE]
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
