"""Bring-your-own reward functions (verl's convention, TRL's batched style) and the built-in
math-verify override, loaded by path through make_task and run in the reward pool."""

import textwrap

import pytest

from bridge.tasks import Prompt, RewardError, cached_task, make_task, score, score_detailed
from bridge.tasks.reward_pool import RewardTimeout, default_pool

REWARDS = """
import time

def exact(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return 1.0 if solution_str.strip() == ground_truth else 0.0

def detailed(data_source, solution_str, ground_truth, extra_info=None):
    ok = solution_str.strip() == ground_truth
    return {"score": 2.0 if ok else -1.0, "acc": ok, "length": len(solution_str),
            "pred": solution_str, "is_arith": data_source == "arithmetic",
            "has_id": extra_info["prompt_id"] == "p1"}

def boom(data_source, solution_str, ground_truth, extra_info=None):
    raise ZeroDivisionError("boom")

def text(data_source, solution_str, ground_truth, extra_info=None):
    return "1.0"

def nodict(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1.0}

def hang(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(60)

def trl(prompts, completions, ground_truth, **kwargs):
    rows = zip(prompts, completions, ground_truth)
    return [float(c.strip() == g) + 0.5 * ("=" in p) for p, c, g in rows]

NOT_A_FUNCTION = 3
"""

P = Prompt("p1", "12+34=", "46")


@pytest.fixture(scope="module")
def rewards(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "my_reward.py"
    path.write_text(textwrap.dedent(REWARDS))
    return str(path)


def test_float_reward_replaces_the_tasks_own(rewards):
    t = make_task("arithmetic", reward_fn=f"{rewards}:exact")
    assert t.options["reward_fn"] == f"{rewards}:exact"
    assert score(t, P, "46") == 1.0
    assert score(t, P, " 46 and more") == 0.0  # the task's own reward would say 1.0
    assert score_detailed(t, P, "46") == (1.0, {})
    assert t.reward_override.stats() == {
        "reward/calls": 3,
        "reward/errors": 0,
        "reward/timeouts": 0,
    }


def test_dict_reward_gives_score_and_numeric_metrics(rewards):
    t = make_task("arithmetic", reward_fn=f"{rewards}:detailed", reward_timeout_s="0")
    value, metrics = score_detailed(t, P, "46")
    assert value == 2.0
    assert metrics == {"acc": 1.0, "length": 2.0, "is_arith": 1.0, "has_id": 1.0}  # no "pred"
    assert score(t, P, "47") == -1.0


@pytest.mark.parametrize("timeout", [0, 5])  # inline, and in the pool
def test_bad_reward_functions_are_clear_errors_naming_the_function(rewards, timeout):
    for name, match in [
        ("boom", "raised ZeroDivisionError: boom"),
        ("text", "returned str '1.0', not a number"),
        ("nodict", "returned a dict without 'score'"),
    ]:
        t = make_task("arithmetic", reward_fn=f"{rewards}:{name}", reward_timeout_s=timeout)
        with pytest.raises(RewardError, match=f"task 'arithmetic': reward_fn .*:{name} {match}"):
            score(t, P, "46")
        assert t.reward_override.stats()["reward/errors"] == 1


def test_a_hanging_reward_function_times_out_in_the_pool(rewards):
    t = make_task("arithmetic", reward_fn=f"{rewards}:hang", reward_timeout_s=1)
    before = default_pool().stats()["reward/timeouts"]
    with pytest.raises(RewardTimeout, match=r"my_reward.py:hang timed out \(limit 1 s\)"):
        score(t, P, "46")
    assert t.reward_override.stats()["reward/timeouts"] == 1
    assert default_pool().stats()["reward/timeouts"] == before + 1
    ok = make_task("arithmetic", reward_fn=f"{rewards}:exact")
    assert score(ok, P, "46") == 1.0  # the pool keeps serving


def test_bad_paths_and_names_fail_when_the_task_is_built(rewards, tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        make_task("arithmetic", reward_fn=f"{tmp_path}/absent.py:f")
    with pytest.raises(ValueError, match="defines no function 'missing'"):
        make_task("arithmetic", reward_fn=f"{rewards}:missing")
    with pytest.raises(ValueError, match="defines no function 'NOT_A_FUNCTION'"):
        make_task("arithmetic", reward_fn=f"{rewards}:NOT_A_FUNCTION")
    with pytest.raises(ValueError, match="must look like 'PATH.py:NAME'"):
        make_task("arithmetic", reward_fn=rewards)
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_module_here\n")
    with pytest.raises(ValueError, match="importing .*broken.py failed"):
        make_task("arithmetic", reward_fn=f"{broken}:f")
    with pytest.raises(ValueError, match="reward_fn_style"):
        make_task("arithmetic", reward_fn=f"{rewards}:exact", reward_fn_style="openai")


def test_relative_paths_are_made_absolute(rewards, monkeypatch, tmp_path):
    import os

    monkeypatch.chdir(os.path.dirname(rewards))
    t = make_task("arithmetic", reward_fn="my_reward.py:exact")
    assert t.options["reward_fn"] == f"{rewards}:exact"
    assert cached_task("arithmetic", t.options).reward(P, "46") == 1.0


def test_trl_style_batched_function(rewards):
    t = make_task("arithmetic", reward_fn=f"{rewards}:trl", reward_fn_style="trl")
    assert score(t, P, "46") == 1.5 and score(t, P, "4") == 0.5


def test_math_verify_override_for_any_task():
    t = make_task("arithmetic", reward="math_verify")
    assert score(t, Prompt("q", "1/2=", "0.5"), "\\frac{1}{2}") == 1.0
    assert score(t, P, "the answer is $46$") == 1.0 and score(t, P, "45") == 0.0
    assert make_task("arithmetic", reward="task").reward(P, " 46 and more") == 1.0
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        make_task("arithmetic", reward="nope")
    with pytest.raises(ValueError, match="not both"):
        make_task("arithmetic", reward="math_verify", reward_fn="x.py:f")
