"""The import rules that keep the two stacks apart (DESIGN.md, "Rules of the house").

Each package is imported module by module in a fresh interpreter, and after each import
the test looks at `sys.modules` for the frameworks that package must not load:
- every `learner_jax` module: no torch, no vllm (and no rollout_gpu);
- every `rollout_gpu` module: no jax, no flax (and no learner_jax);
- every `bridge` module: none of the four (numpy, tensorstore, pydantic only);
- the weights seam (`bridge.weights`: each version kind's writer and loader) sits below
  the planes that call it: it loads neither the controller nor the relay.
A fresh process per package is what makes this honest: in the test session itself other
tests have long since imported everything.

And the controller's rooms (bridge/control/__init__.py): every module in one of them, no
part importing the controller or the HTTP room, no import cycle, and no web framework
loaded outside http/.

The path a version takes (the store, the seam, the worker) has no import cycle, counting
imports inside functions too: the worker's loaders of full and adapter versions once
imported each other.
"""

import ast
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
    "bridge.weights": ("bridge.control", "bridge.broadcast", "learner_jax", "rollout_gpu"),
}

# Packages whose modules may be in no import cycle (any import statement, at any depth).
ACYCLIC = ("rollout_gpu", "bridge.weights", "bridge.store")

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
    where = os.path.join(ROOT, *package.split("."))
    for info in pkgutil.walk_packages([where], prefix=package + "."):
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


# The controller's rooms (bridge/control/__init__.py): one subpackage per concept, and the
# few modules that wire them or speak for all of them at the top.
CONTROL = os.path.join(ROOT, "bridge", "control")
CONTROL_ROOMS = ("state", "leasing", "intake", "trust", "fleet", "evaluation", "http")
CONTROL_TOP = ("protocol", "config", "controller", "learner_api", "process")
# What only the HTTP room may load: the controller decides, the HTTP layer serves.
WEB_FRAMEWORKS = ("fastapi", "starlette", "uvicorn", "prometheus_client")


def control_imports() -> dict[str, set[str]]:
    """module -> the bridge.control modules it imports at module level (not inside a
    function: process.py builds the controller and its server in the child it spawns)."""
    out = {}
    for info in pkgutil.walk_packages([CONTROL], prefix="bridge.control."):
        rel = info.name.split(".")[2:]
        path = os.path.join(CONTROL, *rel, "__init__.py") if info.ispkg else None
        with open(path or os.path.join(CONTROL, *rel) + ".py") as f:
            body = ast.parse(f.read()).body
        # `if TYPE_CHECKING:` and the like are module level too: a use all the same.
        nodes = body + [n for node in body if isinstance(node, ast.If) for n in node.body]
        deps = set()
        for n in nodes:
            if isinstance(n, ast.Import):
                deps |= {a.name for a in n.names if a.name.startswith("bridge.control.")}
            elif isinstance(n, ast.ImportFrom) and (n.module or "").startswith("bridge.control"):
                for a in n.names:  # `from bridge.control.trust import audit`: the module
                    name = f"{n.module}.{a.name}"
                    deps.add(name if _is_module(name) else n.module)
        out[info.name] = deps - {"bridge.control"}
    return out


def _is_module(name: str) -> bool:
    rel = name.split(".")[2:]
    path = os.path.join(CONTROL, *rel)
    return os.path.isfile(path + ".py") or os.path.isdir(path)


def room_of(module: str) -> str:
    """`bridge.control.leasing.leasing` -> "leasing"; a top module -> its own name."""
    return module.split(".")[2]


def test_every_control_module_lives_in_a_room():
    modules = control_imports()
    rooms = {room_of(m) for m in modules}
    assert rooms == set(CONTROL_ROOMS) | set(CONTROL_TOP), rooms
    for m in modules:
        parts = m.split(".")
        assert len(parts) == 3 or (len(parts) == 4 and parts[2] in CONTROL_ROOMS), m


def test_no_part_references_the_controller_or_its_http():
    """The parts never reference the controller (it builds them and passes what they need),
    and nothing outside the HTTP room knows the HTTP layer; process.py, which runs both in
    a child process, imports them only there."""
    for module, deps in control_imports().items():
        room = room_of(module)
        if room in ("http", "process"):
            continue
        if room != "controller":
            assert "bridge.control.controller" not in deps, module
        assert not {d for d in deps if room_of(d) == "http"}, (module, deps)


def test_no_import_cycle_in_the_controller():
    graph = control_imports()
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(m: str, path: list[str]) -> None:
        if state.get(m) == 2:
            return
        assert state.get(m) != 1, " -> ".join(path + [m])
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            visit(d, path + [m])
        state[m] = 2

    for m in sorted(graph):
        visit(m, [])


def test_only_the_http_room_loads_a_web_framework():
    """Every bridge.control module outside http/ (and process.py, which starts the server),
    imported in a fresh interpreter, loads none of the web frameworks."""
    modules = [
        m for m in package_modules("bridge")
        if m.startswith("bridge.control.")
        and room_of(m) not in ("http", "process")
    ]  # fmt: skip
    assert len(modules) > 30, modules
    found = culprits(modules, WEB_FRAMEWORKS)
    assert not found, f"web framework loaded outside bridge/control/http: {found}"


def import_graph(packages=("learner_jax", "rollout_gpu", "bridge")) -> dict[str, set[str]]:
    """module -> the modules of `packages` it imports anywhere in its source."""
    modules = {m for p in packages for m in package_modules(p)}
    graph = {}
    for module in modules:
        path = os.path.join(ROOT, *module.split("."))
        path = os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py"
        with open(path) as f:
            tree = ast.parse(f.read())
        deps = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names)
        graph[module] = {d for d in deps if d in modules and d != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(component)
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return out


def test_the_weights_path_has_no_import_cycle():
    offending = [sorted(c) for c in cycles(import_graph()) if any(m.startswith(ACYCLIC) for m in c)]
    assert not offending, f"import cycles through {ACYCLIC}: {offending}"


def test_the_cycle_check_sees_a_cycle():
    # A lazy import inside a function counts: the loaders' old cycle was two of those.
    graph = import_graph()
    graph["rollout_gpu.adapter_swap"] = graph["rollout_gpu.adapter_swap"] | {
        "rollout_gpu.weight_swap"
    }
    assert {"rollout_gpu.adapter_swap", "rollout_gpu.weight_swap"} <= set().union(*cycles(graph))
