"""The suite's files longest first, by seconds measured per file (tests/durations.json).

xdist hands out whole files (`--dist loadfile`) in collection order, or by default most
tests first, which puts the one-test end-to-end runs of 1-4 minutes last: a long file
started last is the suite's tail while the other worker idles. So under xdist
`conftest.py` sorts the collection longest file first (`--no-loadscope-reorder` keeps that
order); a file not measured yet counts as short.

Refresh the figures from a run's JUnit XML (a file's seconds are the sum of its tests'
times: setup, call and teardown, as pytest reports them; files that did not run keep their
figure, files that no longer exist are dropped):

    pytest -n 2 --dist loadfile -m "not alone" --junitxml=/tmp/suite.xml
    python -m tests.durations /tmp/suite.xml [more.xml ...]

(`make test PYTEST_ARGS=--junitxml=F` would leave only the soak's run in F: its second
pytest run writes the same file.)
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "durations.json")


UNMEASURED_S = 2.0


def measured() -> dict[str, float]:
    with open(OUT) as f:
        return json.load(f)["seconds"]


def longest_files_first(items: list, seconds: dict[str, float]) -> None:
    """Sort pytest items (in place) by their file's seconds, longest first. Stable: tests
    within a file, and files of equal weight, keep their order."""
    items.sort(key=lambda it: -seconds.get(it.nodeid.split("::")[0], UNMEASURED_S))


def file_of(classname: str) -> str | None:
    """`tests.a.b_test.TestX` -> `tests/a/b_test.py`: the longest prefix that is a file."""
    parts = classname.split(".")
    for n in range(len(parts), 0, -1):
        path = "/".join(parts[:n]) + ".py"
        if os.path.exists(os.path.join(ROOT, path)):
            return path
    return None


def file_seconds(junit_paths: list[str]) -> dict[str, float]:
    seconds: dict[str, float] = {}
    for p in junit_paths:
        for case in ET.parse(p).getroot().iter("testcase"):
            path = file_of(case.get("classname", ""))
            if path is not None:
                seconds[path] = seconds.get(path, 0.0) + float(case.get("time", 0.0))
    return seconds


def main(argv: list[str]) -> int:
    if not argv:
        raise SystemExit("usage: python -m tests.durations JUNIT.xml [JUNIT.xml ...]")
    old = {}
    if os.path.exists(OUT):
        with open(OUT) as f:
            old = json.load(f)["seconds"]
    merged = {**old, **{k: round(v, 1) for k, v in file_seconds(argv).items()}}
    merged = {k: v for k, v in merged.items() if os.path.exists(os.path.join(ROOT, k))}
    with open(OUT, "w") as f:
        json.dump({"seconds": dict(sorted(merged.items(), key=lambda kv: -kv[1]))}, f, indent=1)
        f.write("\n")
    total = sum(merged.values())
    print(f"{len(merged)} files, {total / 60:.1f} minutes of test time -> {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
