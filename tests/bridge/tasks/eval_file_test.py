"""`task.eval_file`: local benchmark files in the GSM8K, MATH-500 and AIME layouts (JSONL and
Parquet, as the tests write them) become held-out prompts with their reference answers, and
completions are scored by math-verify (equivalent forms count, wrong answers do not)."""

import json

import pytest

from bridge.tasks import make_task
from bridge.tasks.eval_file import last_boxed, read_eval_file

GSM8K = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7"},
    {"question": "Half of 1,000?", "answer": "1000 / 2 = 500\n#### 500"},
]
MATH500 = [
    {"problem": "What is $1/2 + 1/4$?", "solution": "... $\\boxed{\\frac{3}{4}}$",
     "answer": "\\frac{3}{4}", "subject": "Prealgebra", "level": 2, "unique_id": "test/a.json"},
    {"problem": "Solve $x^2 = 4$, $x > 0$.", "solution": "so $x = \\boxed{2}$.",
     "subject": "Algebra", "level": 1, "unique_id": "test/b.json"},  # reference from \boxed
]  # fmt: skip
AIME = [{"ID": "2024-I-1", "Problem": "Find 2 + 3.", "Answer": 5, "Year": 2024}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_layouts_read_to_questions_and_references(tmp_path):
    g = read_eval_file(write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K))
    assert [(i.question[:8], i.answer) for i in g] == [("Tom has ", "7"), ("Half of ", "500")]
    m = read_eval_file(write_jsonl(tmp_path / "math500.jsonl", MATH500))
    assert [(i.item_id, i.answer, i.subject) for i in m] == [
        ("test/a.json", "\\frac{3}{4}", "Prealgebra"),
        ("test/b.json", "2", "Algebra"),
    ]
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(AIME), str(tmp_path / "aime.parquet"))
    [a] = read_eval_file(str(tmp_path / "aime.parquet"))
    assert (a.item_id, a.question, a.answer, a.subject) == ("2024-I-1", "Find 2 + 3.", "5", "2024")


def test_math_verify_scores_equivalent_answers(tmp_path):
    task = make_task("eval_file", path=write_jsonl(tmp_path / "m.jsonl", MATH500))
    p = task.eval_prompts()[0]
    assert p.prompt_id == "eval_file/test/a.json" and "\\boxed{}" in p.text
    assert task.reward(p, "The sum is $\\boxed{0.75}$.") == 1.0
    assert task.reward(p, "So the answer is $\\boxed{\\frac{6}{8}}$") == 1.0
    assert task.reward(p, "The sum is $\\boxed{\\frac{2}{3}}$.") == 0.0
    g = make_task("eval_file", path=write_jsonl(tmp_path / "g.jsonl", GSM8K), instruction="")
    q = g.eval_prompts()[1]
    assert q.text == GSM8K[1]["question"]
    assert g.reward(q, "1000 / 2 = 500\n#### 500") == 1.0
    assert g.reward(q, "#### 50") == 0.0
    with pytest.raises(ValueError, match="evaluation only"):
        next(g.train_prompts(0))


def test_bad_files_are_refused_with_the_row(tmp_path):
    with pytest.raises(ValueError, match="row 0 has no 'answer'"):
        read_eval_file(write_jsonl(tmp_path / "a.jsonl", [{"question": "q?"}]))
    with pytest.raises(ValueError, match="row 1 has no 'problem' or 'question'"):
        read_eval_file(write_jsonl(tmp_path / "b.jsonl", [GSM8K[0], {"answer": "1"}]))
    with pytest.raises(FileNotFoundError):
        read_eval_file(str(tmp_path / "missing.jsonl"))
    assert last_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{x^{2}}") == "x^{2}"
