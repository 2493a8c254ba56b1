"""The killable reward pool: results, errors, timeouts that kill and replace a worker, and
math-verify run inside it (its equivalences, and a sympy input that really hangs)."""

import math
import operator
import os
import sys
import threading
import time

import pytest

from bridge.tasks import math_reward, reward_pool
from bridge.tasks.base import Prompt, RewardError
from bridge.tasks.registry import score_named
from bridge.tasks.reward_pool import RewardPool, RewardTimeout


@pytest.fixture(scope="module")
def pool():
    # math-verify is preloaded so the timed calls measure verification, not the import.
    with RewardPool(processes=2, timeout_s=30.0, preload=("bridge.tasks.math_reward",)) as p:
        yield p


def test_calls_return_results_and_errors_name_the_function(pool):
    assert pool.call(operator.add, 2, 3) == 5
    assert pool.call(divmod, 7, 2) == (3, 1)
    with pytest.raises(RewardError, match=r"math.sqrt raised ValueError: math domain error"):
        pool.call(math.sqrt, -1)
    with pytest.raises(RewardError, match="cannot be sent to a reward worker"):
        pool.call(lambda: 1)
    assert pool.call(operator.add, 1, 1) == 2  # errors do not cost a worker


def test_a_hanging_call_is_killed_and_the_pool_keeps_serving(pool):
    before = pool.stats()
    pids = {pool.call(os.getpid) for _ in range(4)}
    start = time.monotonic()
    with pytest.raises(RewardTimeout, match=r"time.sleep timed out .*limit 0.5 s"):
        pool.call(time.sleep, 60, timeout_s=0.5)
    assert time.monotonic() - start < 5
    # Every worker still answers, and the stuck one was replaced by a new process.
    after = {pool.call(os.getpid) for _ in range(6)}
    assert len(after) == 2 and after != pids
    stats = pool.stats()
    assert stats["reward/timeouts"] == before["reward/timeouts"] + 1
    assert stats["reward/restarts"] == before["reward/restarts"] + 1
    assert stats["reward/calls"] == before["reward/calls"] + 11


def test_a_worker_that_dies_is_replaced(pool):
    with pytest.raises(RewardError, match=r"worker died \(exit code 3\)"):
        pool.call(os._exit, 3)
    assert pool.call(operator.mul, 6, 7) == 42


def test_concurrent_callers_share_the_workers(pool):
    out = []
    threads = [
        threading.Thread(target=lambda i=i: out.append(pool.call(operator.mul, i, i)))
        for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(out) == [i * i for i in range(8)]


@pytest.mark.parametrize(
    "gold, completion, want",
    [
        ("\\frac{1}{2}", "0.5", 1.0),
        ("0.5", "the answer is $\\frac{1}{2}$", 1.0),
        ("$x=3$", "3", 1.0),
        ("3", "so $x = 3$", 1.0),
        ("1000", "They have 1,000 apples.", 1.0),
        ("12.5", "\\boxed{\\frac{25}{2}}", 1.0),
        ("\\sqrt{2}", "$2^{1/2}$", 1.0),
        ("46", "460", 0.0),
        ("-6", "6", 0.0),
        ("\\frac{1}{2}", "no answer here", 0.0),
    ],
)
def test_math_verify_equivalences_in_the_pool(pool, gold, completion, want):
    assert pool.call(math_reward.math_verify_score, gold, completion) == want


def test_a_pathological_sympy_input_is_killed_by_the_timeout(pool):
    assert pool.call(math_reward.math_verify_score, "5", "5") == 1.0  # warm
    # sympy tries to evaluate the power tower exactly and never returns.
    with pytest.raises(RewardTimeout, match="math_verify_score timed out"):
        pool.call(math_reward.math_verify_score, "$9^{9^{9^{9}}}$", "5", timeout_s=1.5)
    assert pool.call(math_reward.math_verify_score, "\\frac{1}{2}", "0.5") == 1.0


def test_guarded_call_runs_inline_without_a_timeout():
    assert reward_pool.guarded_call(os.getpid, timeout_s=None) == os.getpid()
    assert reward_pool.guarded_call(os.getpid, timeout_s=0) == os.getpid()


def test_a_closed_pool_refuses_calls():
    p = RewardPool(processes=1)
    p.close()
    with pytest.raises(RewardError, match="closed"):
        p.call(operator.add, 1, 2)


def test_the_pool_scores_any_task_by_name(pool):
    # How the trusted side scores a completion: the task rebuilt from (name, options) in a worker.
    p = Prompt("p", "12+34=", "46")
    assert pool.call(score_named, "arithmetic", {"format_reward": 0.25}, p, "47") == (0.25, {})
    with pytest.raises(RewardError, match="unknown task 'nope'"):
        pool.call(score_named, "nope", {}, p, "46")


def test_a_first_import_does_not_count_against_the_calls_timeout(tmp_path, monkeypatch):
    # A reward module that takes 3 s to import (a heavy library on a busy machine): its first
    # call in a fresh worker imports it while unpickling. The call itself is instant.
    (tmp_path / "slow_import_reward.py").write_text(
        "import time\ntime.sleep(3.0)\n\ndef score(x):\n    return x + 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # the worker inherits the parent's sys.path
    import slow_import_reward

    with RewardPool(processes=1, timeout_s=2.0) as fresh:
        assert fresh.call(slow_import_reward.score, 1) == 2
        assert fresh.stats()["reward/timeouts"] == 0
        # A module that fails to import is that call's error, and the worker serves on.
        (tmp_path / "broken_reward.py").write_text("def score(x):\n    return x\n")
        import broken_reward

        (tmp_path / "broken_reward.py").write_text("raise ImportError('no such library')\n")
        with pytest.raises(RewardError, match="no such library"):
            fresh.call(broken_reward.score, 1)
        assert fresh.call(slow_import_reward.score, 2) == 3
        # A module the call names (a task registers itself when imported) loads the same way.
        (tmp_path / "slow_task_module.py").write_text("import time\ntime.sleep(3.0)\n")
        assert fresh.call(_imported, "slow_task_module", imports=("slow_task_module",))
        assert fresh.stats()["reward/timeouts"] == 0


def _imported(module: str) -> bool:
    return module in sys.modules
