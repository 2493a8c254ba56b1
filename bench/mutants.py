"""Mutation testing of the critical modules: how many realistic bugs do their tests miss?

For each module in bench/mutants_targets.toml, mutmut (3.x, the `dev` extra) writes small
changes into a copy of the code (`-` for `+`, `<` for `<=`, a constant off by one, ...) and
runs the module's fast covering tests against each; a mutant the tests still pass is a
survivor, a bug they would not catch. Mutants listed in bench/mutants_equivalents.toml (with
the mutated line and a one-line reason) change nothing observable and are not counted.

    python -m bench.mutants --out=bench/mutants_results.json [--modules=a.py,b.py]
    make mutants [MODULES="bridge/contracts/pass_at_k.py learner_jax/advantages.py"]
    python -m bench.mutants --rescore --modules=...   # after editing the equivalents file

Each module runs in its own scratch directory (`--workdir`/<module>): mutmut reads its
configuration from the pyproject.toml in its working directory and copies the packages into
mutants/ there, so the repository is never touched. The JSON keeps the rows of modules not
rerun from the previous `--out`, so a subset run updates only its own rows; the markdown
report (`--report`) lists the survivors of every row as file:line and the mutated code.

A module's `functions` (in the targets file) restricts its run to the mutants of those
functions, for a module whose whole run would take too long; the row counts only them.

mutmut switches mutants inside each function call (trampolines), so code that runs at import
(a registry's decorator calls) runs before any mutant is selected: its mutants survive whatever
the tests do. Break such code by hand and record the result in the equivalents file.

Headline: `survivor_rate` (survivors / non-equivalent mutants, over every module in the
JSON) and `survivor_rate_by_module`. A survivor is a mutant that survived or that no
selected test reaches; a timeout counts as caught.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGETS = REPO / "bench" / "mutants_targets.toml"
EQUIVALENTS = REPO / "bench" / "mutants_equivalents.toml"
# Hand-written context of the runs (how each was run, before/after, what was left), copied
# to the end of the report.
NOTES = REPO / "bench" / "mutants_notes.md"
# What mutmut copies into mutants/ so that the tests import only mutated code.
PACKAGES = ("bridge", "learner_jax", "rollout_gpu", "bench")

# mutmut's exit-code classes (mutmut/stats.py), kept here so that the report parses results
# without mutmut installed. Everything else is "suspicious" (an odd exit of the test run).
_STATUS = {
    1: "killed",
    3: "killed",  # an internal pytest error under the mutant
    0: "survived",
    5: "no_tests",
    33: "no_tests",
    34: "skipped",
    36: "timeout",
    24: "timeout",  # SIGXCPU: past the CPU-time limit
    -24: "timeout",
    152: "timeout",
    255: "timeout",
    -11: "segfault",
    -9: "segfault",
    37: "type_check",
    None: "not_checked",
}
# Which classes are bugs the tests miss; the rest are caught or not run.
_SURVIVING = ("survived", "no_tests")
_CAUGHT = ("killed", "timeout", "segfault", "type_check")


def status_of(exit_code: int | None) -> str:
    return _STATUS.get(exit_code, "suspicious")


def load_targets(path: Path = TARGETS) -> tuple[dict[str, list[str]], list[str]]:
    """module path -> covering test files, in run order; and the skipped-line patterns."""
    data = tomllib.loads(path.read_text())
    return {m: list(v["tests"]) for m, v in data["modules"].items()}, list(data["skip_lines"])


def load_functions(path: Path = TARGETS) -> dict[str, list[str]]:
    """module path -> the functions its run is restricted to (`functions`; absent = all)."""
    data = tomllib.loads(path.read_text())
    return {m: list(v["functions"]) for m, v in data["modules"].items() if "functions" in v}


def mutant_patterns(module: str, functions: list[str]) -> list[str]:
    """mutmut's mutant-name patterns (fnmatch) of `functions` of `module`: a function f is
    x_f, a method C.m is xǁCǁm; nested functions are mutated as part of their parent."""
    out = []
    for f in functions:
        cls, _, meth = f.rpartition(".")
        local = f"xǁ{cls}ǁ{meth}" if cls else f"x_{f}"
        out.append(f"{module_name(module)}.{local}__mutmut_*")
    return out


def selected(codes: dict[str, int | None], patterns: list[str]) -> dict[str, int | None]:
    """The mutants of a restricted run (all when `patterns` is empty)."""
    if not patterns:
        return codes
    return {m: c for m, c in codes.items() if any(fnmatch.fnmatchcase(m, p) for p in patterns)}


def load_equivalents(path: Path = EQUIVALENTS) -> dict[str, dict]:
    """mutant name -> {"mutation": the mutated line, "reason": why it changes nothing}."""
    if not path.exists():
        return {}
    return {e["mutant"]: e for e in tomllib.loads(path.read_text()).get("equivalent", [])}


def module_name(module: str) -> str:
    """'bridge/weights/delta_codec.py' -> 'bridge.weights.delta_codec' (mutmut's prefix of
    its mutants)."""
    return module.removesuffix(".py").replace("/", ".")


def mutmut_config(module: str, tests: list[str], skip_lines: list[str]) -> str:
    """The [tool.mutmut] table for one module's run."""
    lines = [
        "[tool.mutmut]",
        f"source_paths = {json.dumps(list(PACKAGES))}",
        f"only_mutate = {json.dumps([module])}",
        f"pytest_add_cli_args_test_selection = {json.dumps(tests)}",
        'pytest_add_cli_args = ["-p", "no:cacheprovider"]',
        f"also_copy = {json.dumps(['configs'])}",
        # One process imports the tests (jax included) once and forks a child per mutant;
        # jax starts its threads only on first use, so the fork happens before any.
        'process_isolation = "forkserver"',
        "do_not_mutate_patterns = [" + ", ".join(f"'{p}'" for p in skip_lines) + "]",
    ]
    return "\n".join(lines) + "\n"


def prepare_workdir(workdir: Path, module: str, tests: list[str], skip_lines: list[str]) -> None:
    """A fresh directory that looks like the repository to mutmut: links to its top-level
    entries, and a pyproject.toml that is the repository's plus this module's [tool.mutmut]."""
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    for entry in REPO.iterdir():
        if entry.name in (".git", "pyproject.toml", "mutants", ".venv") or entry.name.startswith(
            "."
        ):
            continue
        (workdir / entry.name).symlink_to(entry)
    pyproject = (REPO / "pyproject.toml").read_text()
    (workdir / "pyproject.toml").write_text(
        pyproject + "\n" + mutmut_config(module, tests, skip_lines)
    )


def run_mutmut(workdir: Path, max_children: int, patterns: list[str]) -> tuple[int, float]:
    """`mutmut run` in workdir (only the mutants matching `patterns`, if any); its spinner
    output goes to workdir/mutmut.log."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only mutants/ imports
    start = time.monotonic()
    with open(workdir / "mutmut.log", "w") as log:
        cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", str(max_children)]
        rc = subprocess.call(
            cmd + patterns,
            cwd=workdir,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    return rc, time.monotonic() - start


def mutant_diff(workdir: Path, mutant: str) -> str:
    """The unified diff of one mutant's function, from `mutmut show`."""
    out = subprocess.run(
        [sys.executable, "-m", "mutmut", "show", mutant],
        cwd=workdir,
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    return out.stdout


def changed_lines(diff: str) -> tuple[list[str], list[str]]:
    """The removed and added lines of a diff, stripped ('-'/'+' and indentation)."""
    removed, added = [], []
    for line in diff.splitlines():
        if line.startswith(("---", "+++")):
            continue
        if line.startswith("-"):
            removed.append(line[1:].strip())
        elif line.startswith("+"):
            added.append(line[1:].strip())
    return removed, added


def _function_span(source: str, mutant: str) -> tuple[int, int] | None:
    """Lines [first, last] of the function a mutant name points at (x_f__mutmut_3, or
    xǁClassǁmethod__mutmut_3 for a method)."""
    local = mutant.rsplit(".", 1)[-1]
    local = re.sub(r"__mutmut_\d+$", "", local)
    parts = local.removeprefix("x").split("ǁ") if "ǁ" in local else [local.removeprefix("x_")]
    parts = [p for p in parts if p]
    nodes = ast.parse(source).body
    node = None
    for name in parts:
        node = next(
            (
                n
                for n in nodes
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                and n.name == name
            ),
            None,
        )
        if node is None:
            return None
        nodes = node.body
    return node.lineno, node.end_lineno


def mutant_line(source: str, mutant: str, diff: str) -> int | None:
    """The line of the original source a mutant changes: its first removed line, found in
    the function's span."""
    span = _function_span(source, mutant)
    if span is None:
        return None
    removed, _ = changed_lines(diff)
    lines = source.splitlines()
    for i in range(span[0] - 1, span[1]):
        if removed and lines[i].strip() == removed[0]:
            return i + 1
    return span[0]


def summarize_module(
    module: str, exit_codes: dict[str, int | None], equivalents: dict[str, dict], diffs: dict
) -> dict:
    """One module's row: counts by class, its survivors and the equivalents applied.

    `diffs` maps each not-caught mutant to its diff. An equivalents entry applies only while
    its recorded `mutation` is still the mutant's added line: after the code moves, mutmut's
    numbering may point the same name at another mutation, which then counts again.
    """
    source = (REPO / module).read_text()
    counts = {k: 0 for k in ("killed", "survived", "no_tests", "timeout", "equivalent", "other")}
    survivors, applied, stale = [], [], []
    for mutant, code in sorted(exit_codes.items(), key=lambda kv: _natural(kv[0])):
        status = status_of(code)
        if status in _CAUGHT:
            counts["timeout" if status == "timeout" else "killed"] += 1
            continue
        if status not in _SURVIVING:
            counts["other"] += 1
            continue
        diff = diffs.get(mutant, "")
        _, added = changed_lines(diff)
        entry = {
            "mutant": mutant,
            "status": status,
            "line": mutant_line(source, mutant, diff),
            "mutation": added[0] if added else "",
            "diff": diff,
        }
        eq = equivalents.get(mutant)
        if eq is not None and eq["mutation"].strip() == entry["mutation"]:
            counts["equivalent"] += 1
            applied.append({**entry, "reason": eq["reason"]})
            continue
        if eq is not None:
            stale.append(mutant)
        counts[status] += 1
        survivors.append(entry)
    total = len(exit_codes)
    scored = total - counts["equivalent"] - counts["other"]
    n_surv = counts["survived"] + counts["no_tests"]
    return {
        "module": module,
        "total": total,
        **counts,
        "survivor_rate": round(n_surv / scored, 4) if scored else 0.0,
        "survivors": survivors,
        "equivalents": applied,
        "stale_equivalents": stale,
    }


def _natural(name: str) -> tuple:
    head, _, num = name.rpartition("__mutmut_")
    return (head, int(num) if num.isdigit() else 0)


def headline(rows: list[dict]) -> dict:
    scored = sum(r["total"] - r["equivalent"] - r["other"] for r in rows)
    surv = sum(r["survived"] + r["no_tests"] for r in rows)
    return {
        "survivor_rate": round(surv / scored, 4) if scored else 0.0,
        "survivor_rate_by_module": {r["module"]: r["survivor_rate"] for r in rows},
        "mutants": sum(r["total"] for r in rows),
        "survivors": surv,
        "equivalents": sum(r["equivalent"] for r in rows),
    }


def _only(row: dict) -> str:
    """' (only f, g)' for a run restricted to some functions."""
    fns = row.get("functions") or []
    return f" (only {', '.join(f'`{f}`' for f in fns)})" if fns else ""


def _before(row: dict) -> str:
    b = row.get("before")
    if not b:
        return "—"
    text = f"{b['survivor_rate']:.1%} ({b['survivors']}/{b['scored']})"
    if b["tests"] != row["tests"]:
        text += " with " + ", ".join(f"`{t}`" for t in b["tests"])
    return text


def previous_run(row: dict) -> dict:
    """What the report's `before` column keeps of a module's earlier row."""
    surv = row["survived"] + row["no_tests"]
    scored = row["total"] - row["equivalent"] - row["other"]
    return {
        "survivor_rate": row["survivor_rate"],
        "survivors": surv,
        "scored": scored,
        "tests": row["tests"],
    }


def render_markdown(result: dict, notes: str = "") -> str:
    """bench/mutants_report.md: the per-module table, then every survivor and equivalent,
    then `notes` (bench/mutants_notes.md)."""
    out = [
        "# Mutation testing report",
        "",
        "Generated by `python -m bench.mutants` (`make mutants`); do not edit by hand.",
        "Reproduce one module: `make mutants MODULES=<module path>`.",
        "",
        f"Overall survivor rate: **{result['headline']['survivor_rate']:.1%}** "
        f"({result['headline']['survivors']} of the non-equivalent mutants).",
        "",
        "| module | tests | mutants | killed | timeout | survived | no tests | equivalent "
        "| survivor rate | before | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        out.append(
            f"| `{r['module']}`{_only(r)} | {', '.join(f'`{t}`' for t in r['tests'])} "
            f"| {r['total']} "
            f"| {r['killed']} | {r['timeout']} | {r['survived']} | {r['no_tests']} "
            f"| {r['equivalent']} | {r['survivor_rate']:.1%} | {_before(r)} | {r['wall_s']:.0f} |"
        )
    out += [
        "",
        "`before`: the module's previous run (its survivors over its scored mutants, and "
        "the tests it ran when they were other ones).",
    ]
    out += ["", "## Survivors", ""]
    any_surv = False
    for r in result["rows"]:
        for s in r["survivors"]:
            any_surv = True
            out.append(
                f"- `{r['module']}:{s['line']}` ({s['status']}) `{s['mutation']}` — `{s['mutant']}`"
            )
        for m in r["stale_equivalents"]:
            out.append(f"- `{m}`: its equivalents entry no longer matches the mutation")
    if not any_surv:
        out.append("None.")
    out += ["", "## Equivalent mutants (bench/mutants_equivalents.toml)", ""]
    for r in result["rows"]:
        for e in r["equivalents"]:
            out.append(f"- `{r['module']}:{e['line']}` `{e['mutation']}` — {e['reason']}")
    if notes.strip():
        out += ["", notes.strip()]
    return "\n".join(out) + "\n"


def score_module(
    workdir: Path, module: str, tests: list[str], equivalents: dict, patterns: list[str] = ()
) -> dict:
    """Read one module's results from its workdir and summarize them (only the mutants
    matching `patterns` when the run was restricted to some functions)."""
    meta = workdir / "mutants" / (module + ".meta")
    if not meta.exists():
        tail = (workdir / "mutmut.log").read_text()[-3000:] if workdir.exists() else ""
        raise RuntimeError(f"mutmut wrote no results for {module} in {workdir}:\n{tail}")
    codes = selected(json.loads(meta.read_text())["exit_code_by_key"], list(patterns))
    diffs = {m: mutant_diff(workdir, m) for m, c in codes.items() if status_of(c) in _SURVIVING}
    row = summarize_module(module, codes, equivalents, diffs)
    row["tests"] = tests
    return row


def main(argv: list[str] | None = None) -> int:
    from absl import flags

    flags.DEFINE_string("out", str(REPO / "bench" / "mutants_results.json"), "JSON output path")
    flags.DEFINE_string("report", str(REPO / "bench" / "mutants_report.md"), "markdown report")
    flags.DEFINE_string("modules", "", "modules to run, comma- or space-separated; all if empty")
    flags.DEFINE_string("workdir", "/tmp/echo2_mutants", "scratch root, one directory per module")
    flags.DEFINE_integer("max_children", 2, "mutants tested in parallel")
    flags.DEFINE_bool("rescore", False, "re-read the last run's results in workdir, run nothing")
    fl = flags.FLAGS
    fl(argv if argv is not None else sys.argv)

    targets, skip_lines = load_targets()
    functions = load_functions()
    modules = fl.modules.replace(",", " ").split() or list(targets)
    unknown = [m for m in modules if m not in targets]
    if unknown:
        raise SystemExit(f"not in {TARGETS.name}: {unknown}; known: {list(targets)}")
    equivalents = load_equivalents()
    out = Path(fl.out)
    previous = json.loads(out.read_text())["rows"] if out.exists() else []
    rows = {r["module"]: r for r in previous if r["module"] in targets}
    for module in modules:
        verb = "rescoring the last run" if fl.rescore else "mutating"
        print(f"{module}: {verb}, tests {' '.join(targets[module])}", flush=True)
        workdir = Path(fl.workdir) / module_name(module)
        patterns = mutant_patterns(module, functions.get(module, []))
        wall, rc = rows.get(module, {}).get("wall_s", 0.0), 0
        if not fl.rescore:
            prepare_workdir(workdir, module, targets[module], skip_lines)
            rc, wall = run_mutmut(workdir, fl.max_children, patterns)
        row = score_module(workdir, module, targets[module], equivalents, patterns)
        row.update(wall_s=round(wall, 1), mutmut_rc=rc, functions=functions.get(module, []))
        earlier = rows.get(module)
        if earlier is not None:  # a rerun compares with the last run; a rescore keeps it
            row["before"] = earlier.get("before") if fl.rescore else previous_run(earlier)
        rows[module] = row
        print(
            f"  {row['total']} mutants: {row['killed']} killed, {row['timeout']} timeout, "
            f"{row['survived']} survived, {row['no_tests']} untested, {row['equivalent']} "
            f"equivalent -> survivor rate {row['survivor_rate']:.1%} ({row['wall_s']:.0f} s)",
            flush=True,
        )
    ordered = [rows[m] for m in targets if m in rows]
    result = {"headline": headline(ordered), "rows": ordered}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    notes = NOTES.read_text() if NOTES.exists() else ""
    Path(fl.report).write_text(render_markdown(result, notes))
    print(json.dumps(result["headline"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
