"""The suite's file order under xdist (tests/durations.py): JUnit times summed per file,
longest file first, tests within a file kept in order."""

import dataclasses

from tests import durations

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
<testcase classname="tests.durations_test" name="a" time="1.5"/>
<testcase classname="tests.bridge.broadcast.state_test" name="b" time="0.25"/>
<testcase classname="tests.durations_test" name="c" time="2.0"/>
<testcase classname="tests.bridge.broadcast.state_test.TestSomething" name="d" time="0.5"/>
<testcase classname="tests.gone_test" name="e" time="9.0"/>
</testsuite></testsuites>
"""


def test_seconds_are_summed_per_file_and_classes_map_to_their_file(tmp_path):
    path = tmp_path / "suite.xml"
    path.write_text(JUNIT)
    assert durations.file_seconds([str(path)]) == {
        "tests/durations_test.py": 3.5,
        "tests/bridge/broadcast/state_test.py": 0.75,
    }


@dataclasses.dataclass
class Item:
    nodeid: str


def test_longest_file_first_tests_of_a_file_stay_together_and_in_order():
    items = [Item(n) for n in ("s.py::1", "l.py::1", "s.py::2", "new.py::1", "l.py::2",
                               "m.py::1")]  # fmt: skip
    durations.longest_files_first(items, {"s.py": 1.0, "l.py": 90.0, "m.py": 30.0})
    assert [i.nodeid for i in items] == [
        "l.py::1", "l.py::2", "m.py::1", "new.py::1", "s.py::1", "s.py::2",
    ]  # fmt: skip
