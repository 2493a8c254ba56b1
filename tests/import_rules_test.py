"""The import rules that keep the two stacks apart (DESIGN.md, "Rules of the house").

Each package is imported module by module in a fresh interpreter, and after each import
the test looks at `sys.modules` for the frameworks that package must not load:
- every `learner_jax` module: no torch, no vllm (and no rollout_gpu);
- every `rollout_gpu` module: no jax, no flax (and no learner_jax);
- every `bridge` module: none of the four (numpy, tensorstore, pydantic only).
A fresh process per package is what makes this honest: in the test session itself other
tests have long since imported everything.
"""

import json
import os
import pkgutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FORBIDDEN = {
    "learner_jax": ("torch", "vllm", "rollout_gpu"),
    "rollout_gpu": ("jax", "flax", "learner_jax"),
    "bridge": ("jax", "flax", "torch", "vllm", "learner_jax", "rollout_gpu"),
}

# Run in the child: import each module in turn, record which forbidden roots appeared first
# after which module, so a failure names the module that pulled the framework in.
_CHILD = r"""
import importlib, json, sys
modules, forbidden = json.loads(sys.argv[1]), json.loads(sys.argv[2])
culprits = {}
for name in modules:
    importlib.import_module(name)
    for root in forbidden:
        if root in sys.modules and root not in culprits:
            culprits[root] = name
print(json.dumps(culprits))
"""


def package_modules(package: str) -> list[str]:
    """Every module of `package` (subpackages included), found on disk, not by importing."""
    out = [package]
    for info in pkgutil.walk_packages([os.path.join(ROOT, package)], prefix=package + "."):
        out.append(info.name)
    return sorted(out)


def culprits(modules: list[str], forbidden: tuple[str, ...]) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": ROOT}
    res = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(modules), json.dumps(list(forbidden))],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, f"importing {modules} failed:\n{res.stderr[-3000:]}"
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_loads_no_forbidden_framework(package):
    modules = package_modules(package)
    assert len(modules) > 3, modules  # the walk found the package's files
    found = culprits(modules, FORBIDDEN[package])
    assert not found, (
        f"{package}: forbidden imports (framework -> first module that loaded it): {found}"
    )


def test_the_check_sees_a_forbidden_import():
    # The same machinery must report a root that is imported (numpy: the store loads it),
    # so an empty result above means absent, not unchecked.
    found = culprits(["bridge.store.weight_store"], ("numpy",))
    assert found == {"numpy": "bridge.store.weight_store"}
