"""How many times this process has traced or compiled with XLA (jax.monitoring events).

The capacity model averages the learner's times per update (bridge/control/fleet/fleet_plan.py).
A compile is paid once: the train step's first shapes, the first audit re-score (step 10 of
the demo: ~1 s of "overhead" in a 0.08 s-per-update mean), the first evaluation. Counted as
a cost per update it made the live prediction warn "the learner will wait" early in a run
whose measured utilization was 15 points higher (stop 38's CI). Publish (hooks.py) reports
an update period in which this count moved as cold, and the controller leaves it out.
"""

from __future__ import annotations

import threading

import jax

_PREFIX = "/jax/core/compile/"  # jaxpr trace, MLIR lowering, backend compile (jax._src.dispatch)

_lock = threading.Lock()
_count = 0
_listening = False


def _on_duration(event: str, duration_s: float, **_) -> None:
    global _count
    if event.startswith(_PREFIX):
        with _lock:
            _count += 1


def count() -> int:
    """Compile events so far in this process (listening from the first call on)."""
    global _listening
    with _lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            _listening = True
        return _count
