"""Nothing outside the weights seam (bridge/weights/) decides what kind a version is.

A version's kind (full, delta, LoRA adapter) is read from its manifest in one place,
bridge/weights/kinds.py, and acted on by its strategy; the learner, the workers, the store
and the relay call the strategy. This scans the source of every module of learner_jax,
rollout_gpu and bridge outside the seam for the ways code has asked which kind it holds:

- the adapter markers: a comparison with "lora_adapter" / "lora_base", the marker
  constants (`adapter_store.KIND`, `BASE_KIND`), or reading `extra["kind"]` /
  `extra.get("kind")` of a manifest;
- the delta marker: `X.delta` (or `getattr(X, "delta")`) tested against None or for truth,
  and `X.is_full`;
- the seam's own answers used to branch: `Kind.*`, `kind_of(...)`, `isinstance` against a
  strategy or writer class.

bridge/store/manifest.py defines those fields (its properties read its own `delta`), so it
is the one file outside the seam allowed to. Tests and benches inspect kinds on purpose
and are not scanned.
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PACKAGES = ("learner_jax", "rollout_gpu", "bridge")
SEAM = os.path.join("bridge", "weights") + os.sep
FORMAT = os.path.join("bridge", "store", "manifest.py")  # defines the fields the seam reads

MARKERS = {"lora_adapter", "lora_base"}
MARKER_NAMES = {"KIND", "BASE_KIND"}
SEAM_CLASSES = {
    "FullVersions", "DeltaVersions", "AdapterVersions",
    "FullWriter", "DeltaWriter", "AdapterWriter", "PlainEngine", "LoraBase",
}  # fmt: skip


def _is_none(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def _delta_ref(node) -> bool:
    """`X.delta` or `getattr(X, "delta", ...)`."""
    if isinstance(node, ast.Attribute) and node.attr == "delta":
        return True
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value == "delta"
    )


def _kind_key(node) -> bool:
    return isinstance(node, ast.Constant) and node.value == "kind"


def _mentions_extra(node) -> bool:
    return "extra" in ast.unparse(node)


def kind_branches(source: str) -> list[tuple[int, str]]:
    """(line, what) of every place in `source` that asks which kind a version is."""
    found = []
    for node in ast.walk(ast.parse(source)):
        what = None
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Constant) and s.value in MARKERS for s in sides):
                what = "compares with an adapter marker"
            elif any(_delta_ref(s) for s in sides) and any(_is_none(s) for s in sides):
                what = "tests a manifest's delta against None"
        elif isinstance(node, ast.If | ast.IfExp | ast.While | ast.Assert):
            if _delta_ref(node.test):
                what = "tests a manifest's delta for truth"
        elif isinstance(node, ast.BoolOp) or (
            isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not)
        ):
            values = node.values if isinstance(node, ast.BoolOp) else [node.operand]
            if any(_delta_ref(v) for v in values):
                what = "tests a manifest's delta for truth"
        elif isinstance(node, ast.Attribute):
            if node.attr == "is_full":
                what = "reads is_full"
            elif node.attr in MARKER_NAMES:
                what = f"uses the marker {node.attr}"
            elif isinstance(node.value, ast.Name) and node.value.id == "Kind":
                what = f"uses Kind.{node.attr}"
        elif isinstance(node, ast.ImportFrom) and node.module and "weights" in node.module:
            names = {a.name for a in node.names}
            if names & (MARKER_NAMES | {"Kind", "kind_of"}):
                what = f"imports {sorted(names & (MARKER_NAMES | {'Kind', 'kind_of'}))}"
        elif isinstance(node, ast.Subscript) and _kind_key(node.slice):
            if _mentions_extra(node.value):
                what = 'reads extra["kind"]'
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "get" and node.args and _kind_key(node.args[0]):
                if _mentions_extra(func.value):
                    what = 'reads extra.get("kind")'
            elif name == "kind_of":
                what = "calls kind_of"
            elif name == "isinstance" and len(node.args) == 2:
                classes = ast.unparse(node.args[1])
                if any(c in classes for c in SEAM_CLASSES):
                    what = f"isinstance against {classes}"
        if what is not None:
            found.append((node.lineno, what))
    return sorted(set(found))


def modules_outside_the_seam() -> list[str]:
    out = []
    for package in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, package)):
            for f in files:
                rel = os.path.relpath(os.path.join(dirpath, f), ROOT)
                if f.endswith(".py") and not rel.startswith(SEAM) and rel != FORMAT:
                    out.append(rel)
    return sorted(out)


def test_no_module_outside_the_seam_branches_on_the_version_kind():
    modules = modules_outside_the_seam()
    assert len(modules) > 100, modules  # the walk found the packages
    offenders = {}
    for rel in modules:
        with open(os.path.join(ROOT, rel)) as f:
            found = kind_branches(f.read())
        if found:
            offenders[rel] = found
    assert not offenders, (
        "modules outside bridge/weights/ that decide the version kind (ask the strategy, "
        f"bridge/weights/kinds.py, instead): {offenders}"
    )


def test_the_seam_itself_is_where_the_kind_is_read():
    # The same scan finds the kind decisions inside the seam: an empty result above means
    # none outside, not a scan that sees nothing.
    with open(os.path.join(ROOT, "bridge", "weights", "kinds.py")) as f:
        found = {what for _, what in kind_branches(f.read())}
    assert {'reads extra.get("kind")', "tests a manifest's delta against None"} <= found


# Branches as they were written before the seam existed (each one, planted anywhere
# outside bridge/weights/, must be found).
PLANTED = {
    "adapter marker": 'if extra.get("kind") == "lora_adapter":\n    pass',
    "marker constant": "ok = manifest.extra.get('kind') != adapter_store.BASE_KIND",
    "subscript": 'is_adapter = manifest.extra["kind"] == KIND',
    "delta is None": 'if getattr(manifest, "delta", None) is None:\n    pass',
    "delta attribute": "if self.delta is not None:\n    self.delta.forget()",
    "delta truth": "x = m.delta.nbytes if m.delta else 0",
    "is_full": "every_key = not manifest.is_full or held == set(manifest.arrays)",
    "seam enum": "if kinds.kind_of(m) is kinds.Kind.ADAPTER:\n    pass",
    "isinstance": "if isinstance(writer, DeltaWriter):\n    pass",
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_planted_kind_branch_is_found(name):
    assert kind_branches(PLANTED[name]), name


def test_kind_free_code_is_not_flagged():
    # What callers of the seam write, and look-alikes that are not about versions.
    clean = "\n".join([
        "strategy = kinds.strategy_of(manifest)",
        "tensors = strategy.load(side, store, version, manifest)",
        "d = config.bridge.delta",
        "bad = {(r['source'], r['kind']): r['key'] for r in reports}",
        "if fmt.kind != 'chat':\n    pass",
    ])  # fmt: skip
    assert kind_branches(clean) == []
