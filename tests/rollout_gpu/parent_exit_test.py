"""A local worker outlives a training binary killed -9 only until it notices
(rollout_gpu/lifecycle.py: stop_when_parent_exits; the local fleet passes
`--exit_with_parent`). Real processes: a parent that starts a child running the worker's
stop path, then the parent is SIGKILLed. No vLLM: the mechanism is the stop path itself."""

import os
import signal
import subprocess
import sys
import time

CHILD = r"""
import os, sys, time
from rollout_gpu import lifecycle
marker = sys.argv[1]
def request_stop():
    with open(marker, "w") as f:
        f.write("stopped")
    os._exit(0)
lifecycle.install_stop_signals(request_stop, grace_s=0.5)
lifecycle.stop_when_parent_exits(os.getppid(), period_s=0.2)
print("ready", flush=True)
time.sleep(60)
"""
PARENT = r"""
import subprocess, sys, time
cmd = [sys.executable, "-c", sys.argv[1], sys.argv[2]]
child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
time.sleep(60)
"""


def test_a_child_stops_when_its_parent_is_killed(tmp_path):
    marker = tmp_path / "stopped"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, CHILD, str(marker)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        child_pid = int(parent.stdout.readline())
        time.sleep(1.0)  # five watch periods with the parent alive: no stop
        assert not marker.exists()
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 20
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert marker.read_text() == "stopped"
    finally:
        parent.kill()
        try:
            os.kill(child_pid, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass
