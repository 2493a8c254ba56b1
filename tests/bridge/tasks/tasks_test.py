"""Task adapters: registry, seeded prompt streams, held-out splits, rewards, safe scoring."""

import itertools
import json
import math

import pytest

from bridge import tasks
from bridge.model.tiny_model import char_vocab
from bridge.tasks import Prompt, RewardError, Task, make_task, register_task, score
from bridge.tasks.gsm8k import final_number


def _take(it, n):
    return list(itertools.islice(it, n))


def test_registry_lists_builtins_and_refuses_unknown():
    assert {"arithmetic", "gsm8k"} <= set(tasks.available_tasks())
    with pytest.raises(KeyError, match="unknown task 'nope'"):
        make_task("nope")
    with pytest.raises(ValueError, match="registered twice"):
        register_task("arithmetic")(Task)


def test_arithmetic_is_seeded_correct_and_tokenizable():
    t = make_task("arithmetic", digits=3, ops="+-*")
    a, b = _take(t.train_prompts(7), 500), _take(t.train_prompts(7), 500)
    assert a == b
    assert a != _take(t.train_prompts(8), 500)
    vocab = char_vocab()
    ops_seen = set()
    for p in a:
        # Recompute every answer independently with Python's own parser of the expression.
        expr = p.text.removesuffix("=")
        assert p.text.endswith("=") and str(eval(expr)) == p.answer  # noqa: S307
        assert all(ch in vocab for ch in p.text + p.answer)
        assert int(p.answer) >= 0  # allow_negative=False keeps a - b >= 0
        ops_seen |= {op for op in "+-*" if op in expr}
    assert ops_seen == {"+", "-", "*"}
    assert len({p.prompt_id for p in a}) == len(a)


def test_arithmetic_digit_knobs():
    t = make_task("arithmetic", digits=4, min_digits=4, ops="+")
    for p in _take(t.train_prompts(0), 200):
        x, y = p.text[:-1].split("+")
        assert len(x) == 4 and len(y) == 4
    with pytest.raises(ValueError):
        make_task("arithmetic", digits=2, min_digits=3)
    with pytest.raises(ValueError):
        make_task("arithmetic", ops="/")


def test_arithmetic_eval_split_is_fixed_and_disjoint_from_training():
    t = make_task("arithmetic", digits=2, eval_size=100)
    ev = t.eval_prompts()
    assert len(ev) == 100 and ev == t.eval_prompts()
    held = {p.text for p in ev}
    train = {p.text for p in _take(t.train_prompts(0), 20_000)}
    assert not held & train


def test_arithmetic_reward():
    t = make_task("arithmetic")
    p = Prompt("x", "12+34=", "46")
    assert score(t, p, "46") == 1.0
    assert score(t, p, " 46 and more") == 1.0  # leading integer decides
    assert score(t, p, "47") == 0.0
    assert score(t, p, "abc") == 0.0
    assert score(t, p, "") == 0.0
    assert score(t, p, "460") == 0.0
    shaped = make_task("arithmetic", format_reward=0.1)
    assert score(shaped, p, "47") == 0.1 and score(shaped, p, "x") == 0.0
    strict = make_task("arithmetic", strict=True)
    assert score(strict, p, "46 ") == 1.0 and score(strict, p, "46x") == 0.0
    neg = make_task("arithmetic", allow_negative=True, ops="-")
    answers = [int(q.answer) for q in _take(neg.train_prompts(0), 200)]
    assert min(answers) < 0
    q = Prompt("y", "3-9=", "-6")
    assert score(neg, q, "-6") == 1.0 and score(neg, q, "6") == 0.0


def test_arithmetic_sft_examples_are_prompt_answer_pairs():
    t = make_task("arithmetic")
    ex = _take(t.sft_examples(0), 5)
    assert ex == [(p.text, p.answer) for p in _take(t.train_prompts(0), 5)]


def test_sft_label_noise_overshoots_only_sft_targets_by_one():
    clean, noisy = make_task("arithmetic"), make_task("arithmetic", sft_label_noise=0.75)
    pairs = _take(noisy.sft_examples(0), 4000)
    assert [p for p, _ in pairs] == [p for p, _ in _take(clean.sft_examples(0), 4000)]
    # The truth from the prompt text itself (an independent evaluation, not the task's answer).
    diffs = [int(a) - eval(p.rstrip("=")) for p, a in pairs]
    assert set(diffs) == {0, 1}
    assert abs(diffs.count(1) / len(diffs) - 0.75) < 0.03
    # Rewards and the held-out set are untouched.
    assert noisy.eval_prompts() == clean.eval_prompts()
    q = noisy.eval_prompts()[0]
    assert noisy.reward(q, q.answer) == 1.0
    with pytest.raises(ValueError, match="sft_label_noise"):
        make_task("arithmetic", sft_label_noise=1.5)


class _Bad(tasks.Arithmetic):  # only the reward matters here
    name = "bad"

    def __init__(self, result):
        self.result = result

    def reward(self, prompt, completion):
        if isinstance(self.result, Exception):
            raise self.result
        return self.result


@pytest.mark.parametrize(
    "result, match",
    [
        (ZeroDivisionError("boom"), "raised ZeroDivisionError: boom"),
        ("1.0", "returned str"),
        (None, "returned NoneType"),
        (True, "returned bool"),
        (math.nan, "not finite"),
        (math.inf, "not finite"),
    ],
)
def test_bad_reward_functions_give_a_clear_error(result, match):
    with pytest.raises(RewardError, match=match):
        score(_Bad(result), Prompt("p1", "q", "a"), "c")


def test_score_accepts_ints_and_returns_float():
    out = score(_Bad(1), Prompt("p1", "q", "a"), "c")
    assert out == 1.0 and type(out) is float


def _gsm8k_file(path, n):
    rows = [
        {
            "question": f"Tom has {i} apples and buys {i + 1000} more. How many?",
            "answer": f"{i} + {i + 1000} = {2 * i + 1000}\n#### {2 * i + 1000:,}",
        }
        for i in range(n)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return rows


def test_final_number_extraction():
    assert final_number("so 3 + 4 = 7\n#### 1,234") == "1234"
    assert final_number("the answer is 12.50.") == "12.5"
    assert final_number("first 3 then 8") == "8"
    assert final_number("#### -5 apples") == "-5"
    assert final_number("no digits") is None


@pytest.mark.parametrize("answer_check", ["math_verify", "final_number"])
def test_gsm8k_reads_local_jsonl(tmp_path, answer_check):
    path = tmp_path / "train.jsonl"
    rows = _gsm8k_file(path, 30)
    t = make_task("gsm8k", path=str(path), answer_check=answer_check)
    ev = t.eval_prompts()
    assert [p.prompt_id for p in ev] == [f"gsm8k/eval/{i}" for i in range(0, 30, 10)]
    train = _take(t.train_prompts(0), 27)
    assert len({p.prompt_id for p in train}) == 27  # one full epoch, no repeats
    assert not {p.prompt_id.split("/")[-1] for p in train} & {"0", "10", "20"}
    for p in train:
        i = int(p.prompt_id.split("/")[-1])
        assert rows[i]["question"] in p.text and p.answer == str(2 * i + 1000)
        assert score(t, p, f"They have {p.answer} apples.") == 1.0
        assert score(t, p, f"... #### {int(p.answer):,}") == 1.0
        assert score(t, p, "I do not know") == 0.0
        assert score(t, p, f"{int(p.answer) + 1}") == 0.0
    prompt, target = next(t.sft_examples(0))
    assert prompt.startswith("Question: ") and "####" in target


def test_gsm8k_answer_checks_agree_on_numbers_and_math_verify_reads_more(tmp_path):
    mv = make_task("gsm8k", path=str(tmp_path / "absent.jsonl"))
    num = make_task("gsm8k", path=str(tmp_path / "absent.jsonl"), answer_check="final_number")
    p = Prompt("p", "q", "12.5")
    for text, want in [
        ("so 12.5", 1.0),
        ("the answer is 12.50.", 1.0),
        ("#### 12.5\nthen 3 more words: 7", 1.0),  # only the line after #### counts
        ("12.5 #### 13", 0.0),
        ("12", 0.0),
        ("nothing", 0.0),
    ]:
        assert score(mv, p, text) == score(num, p, text) == want, text
    # Equivalent forms only math-verify accepts (the hand-written check reads 2 or 12.5x).
    assert score(mv, p, "\\boxed{\\frac{25}{2}}") == 1.0
    assert score(num, p, "\\boxed{\\frac{25}{2}}") == 0.0
    with pytest.raises(ValueError, match="answer_check"):
        make_task("gsm8k", path="x", answer_check="regex")


def test_gsm8k_bad_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match="needs string fields"):
        make_task("gsm8k", path=str(bad)).eval_prompts()
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="not JSON"):
        make_task("gsm8k", path=str(bad)).eval_prompts()
    bad.write_text(json.dumps({"question": "q", "answer": "none"}) + "\n")
    with pytest.raises(ValueError, match="no final number"):
        next(make_task("gsm8k", path=str(bad)).train_prompts(0))


def test_workers_rebuild_the_reward_from_name_and_options(tmp_path):
    t = make_task("arithmetic", format_reward=0.25, digits=3)
    assert t.options == {"format_reward": 0.25, "digits": 3}
    same = tasks.cached_task("arithmetic", t.options)
    assert same is tasks.cached_task("arithmetic", dict(reversed(t.options.items())))
    assert score(same, Prompt("p", "1+2=", "3"), "4") == 0.25
    # A worker without the data file can still score gsm8k completions.
    g = tasks.cached_task("gsm8k", {"path": str(tmp_path / "absent.jsonl")})
    assert score(g, Prompt("p", "q", "42"), "so #### 42") == 1.0
    with pytest.raises(FileNotFoundError):
        g.eval_prompts()
