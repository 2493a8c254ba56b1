"""Fixtures shared by the rollout_gpu tests."""

import pytest

from rollout_gpu.relay import Relay


@pytest.fixture
def relays():
    """`relays(**kwargs)` starts a real relay (rollout_gpu/relay.py) on loopback; every one
    started is stopped after the test, also one the test stopped itself."""
    started = []

    def make(**kwargs):
        relay = Relay(**kwargs)
        relay.start()
        started.append(relay)
        return relay

    yield make
    for relay in started:
        try:
            relay.stop()
        except Exception:  # noqa: BLE001 - a test may have stopped it already
            pass
