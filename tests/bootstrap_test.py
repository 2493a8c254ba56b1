"""The Makefile's bootstrap is idempotent: once the venv is complete, `make` installs nothing."""

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(
    not os.path.exists(os.path.join(ROOT, ".venv", ".echo2-installed")),
    reason="venv not bootstrapped by make (running outside `make test`)",
)
def test_second_make_installs_nothing():
    # -q: exit 0 iff the stamp is up to date, i.e. a second `make test` would not reinstall.
    res = subprocess.run(["make", "-q", "venv"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, "make would reinstall the venv: " + res.stdout + res.stderr
    dry = subprocess.run(["make", "-n", "test"], cwd=ROOT, capture_output=True, text=True)
    assert "pip install" not in dry.stdout
