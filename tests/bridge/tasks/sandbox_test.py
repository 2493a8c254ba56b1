"""The tool sandbox's limits, each with a tool that breaks it: the call is stopped and the
reason comes back as text (`ToolResult.ok` False), never as an exception; the sandbox
keeps answering afterwards. Tool calls parsed from Qwen3's format, and a tool
environment that answers a malformed call or a stopped tool as an observation."""

import socket
import subprocess
import sys
import textwrap

import pytest

from bridge.tasks.sandbox import Limits, Sandbox, network_isolation
from bridge.tasks.tool_calls import MalformedCall, ToolCall, parse_tool_calls

TOOLS = """
import os, socket, subprocess, time

def add(a, b):
    return a + b

def spin():
    while True:
        pass

def nap():
    time.sleep(60)

def hog():
    return len(bytearray(1 << 30))

def dial(port):
    socket.create_connection(("127.0.0.1", port), timeout=2).sendall(b"leak")
    return "connected"

def read(path):
    with open(path) as f:
        return f.read()

def write(path):
    with open(path, "w") as f:
        f.write("x")
    return "written"

def scratch():
    with open("note.txt", "w") as f:
        f.write("kept here")
    with open("note.txt") as f:
        return f.read() + " in " + os.getcwd()

def shell():
    return subprocess.run(["true"]).returncode
"""


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    where = tmp_path_factory.mktemp("tools")
    (where / "sandbox_tools.py").write_text(textwrap.dedent(TOOLS))
    sys.path.insert(0, str(where))  # the zygote imports tools on the caller's path
    b = Sandbox(Limits(cpu_s=1, wall_s=3.0, memory_mb=64))
    yield b
    b.close()
    sys.path.remove(str(where))


def call(box, name, **kw):
    return box.call(f"sandbox_tools:{name}", kw)


def test_a_tool_runs_in_a_fresh_scratch_directory(box):
    assert call(box, "add", a=2, b=3).text == "5"
    first, second = call(box, "scratch"), call(box, "scratch")
    assert first.ok and first.text.startswith("kept here in ")
    assert first.text != second.text  # a fresh directory per call


def test_a_looping_tool_is_stopped_by_its_cpu_limit(box):
    # A wall clock far past 1 CPU second on any load: the CPU limit is what stops it.
    patient = Sandbox(Limits(cpu_s=1, wall_s=300.0, memory_mb=64))
    r = call(patient, "spin")
    assert not r.ok and "CPU time" in r.text
    assert call(patient, "add", a=1, b=1).text == "2"  # the sandbox lives on
    patient.close()


def test_a_sleeping_tool_is_stopped_by_the_wall_clock(box):
    r = call(box, "nap")
    assert not r.ok and "wall-clock" in r.text


def test_an_allocating_tool_is_stopped_by_its_memory_limit(box):
    r = call(box, "hog")
    assert not r.ok and "memory limit" in r.text


def test_a_tool_that_opens_a_socket_is_stopped_and_reaches_nothing(box):
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)
    r = call(box, "dial", port=server.getsockname()[1])
    assert not r.ok and "network" in r.text
    with pytest.raises(TimeoutError):
        server.accept()
    server.close()


def test_files_outside_the_scratch_directory_are_refused(box, tmp_path):
    r = call(box, "read", path="/etc/hostname")
    assert not r.ok and "outside the scratch directory" in r.text
    r = call(box, "write", path=str(tmp_path / "escaped"))
    assert not r.ok and not (tmp_path / "escaped").exists()


def test_starting_a_process_is_refused(box):
    r = call(box, "shell")
    assert not r.ok and "processes" in r.text


def test_bad_arguments_and_unknown_tools_are_results(box):
    assert not call(box, "add", a=1).ok
    assert "cannot be loaded" in box.call("sandbox_tools:nope", {}).text
    assert not box.call("sandbox_tools:add", ["not", "a", "dict"]).ok


def test_the_network_namespace_has_no_route():
    prefix, name = network_isolation()
    if not prefix:
        pytest.skip("no unshare here: the audit hook is the only network layer")
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"
    out = subprocess.run([*prefix, sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0 and (
        "Network is unreachable" in out.stderr or "refused" in out.stderr
    )
    server.close()


def test_qwen3_tool_calls_are_parsed_and_malformed_ones_say_why():
    text = (
        '<think>maybe <tool_call>{"name": "x"}</tool_call></think>\n'
        '<tool_call>\n{"name": "calc", "arguments": {"expr": "1+2"}}\n</tool_call>\n'
        '<tool_call>{"name": "calc", "arguments": "{\\"expr\\": \\"3\\"}"}</tool_call>'
        '<tool_call>{name: calc}</tool_call><tool_call>[1]</tool_call><tool_call>{"name": "c"'
    )
    calls = parse_tool_calls(text)
    assert calls[:2] == [ToolCall("calc", {"expr": "1+2"}), ToolCall("calc", {"expr": "3"})]
    assert [type(c) for c in calls[2:]] == [MalformedCall] * 3
    assert "not JSON" in calls[2].error and "object" in calls[3].error
    assert "no closing" in calls[4].error
    assert parse_tool_calls("just 42") == []


def test_a_tool_environment_answers_errors_as_observations():
    from bridge.tasks import make_env
    from bridge.tasks.tool_arith import call_text

    env = make_env("tool_arith", cpu_s=1, wall_s=3.0)
    env.reset(7)
    obs, reward, done = env.step(
        '<tool_call>{"name": "calc", "arguments": {"expr": "1+"}</tool_call>'
    )
    assert not done and reward == 0.0 and "error: malformed tool call" in obs
    obs, _, done = env.step(call_text("9**9**9**9"))  # no power operator: refused, not run
    assert not done and "error:" in obs
    obs, _, done = env.step('<tool_call>{"name": "shell", "arguments": {}}</tool_call>')
    assert not done and "unknown tool 'shell'" in obs
