"""`python -m learner_jax.evaluate`'s scoring and table (learner_jax/evaluation/eval_cli.py):
completions go through the controller's trusted scorer (math-verify on a benchmark file's
references, hidden tokens 0) and the table's pass@k is the closed form over the per-prompt counts,
overall and per subject. The vLLM part (rollout_gpu/batch_generate.py in local worker processes) is
the worker's engine path; the whole command was run on the tiny model (the command and its table are
in BUILD_NOTES.md)."""

import json
import math
from fractions import Fraction

import pytest

from bridge.model.tiny_model import EOS_ID, PAD_ID
from bridge.tasks.eval_file import EvalFileTask
from learner_jax.evaluation import eval_cli

ROWS = [
    {"problem": "1+2=", "answer": "3", "subject": "add"},
    {"problem": "9-4=", "answer": "5", "subject": "sub"},
    {"problem": "2+2=", "answer": "4", "subject": "add"},
]
SAMPLES = [  # per prompt: completion texts (None = a hidden token inside a right answer)
    ["3", "4", "3", "12"],
    ["6", "7", "8", "9"],
    ["4", None, "4", "4"],
]


def closed(n, c, k):
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


def test_scores_and_table_match_the_closed_form(tmp_path, tiny_model_dir):
    path = tmp_path / "f.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    task = EvalFileTask(str(path), instruction="")
    codec = eval_cli.make_codec(tiny_model_dir, "auto", "plain")
    prompts = task.eval_prompts()
    requests = eval_cli.requests_for(
        [codec.encode_prompt(p.text) for p in prompts], eval_cli.Sampling(n=4), [EOS_ID]
    )
    completions = []
    for texts in SAMPLES:
        group = []
        for t in texts:
            ids = codec.encode("4") + [PAD_ID] + codec.encode("4") if t is None else codec.encode(t)
            ids = ids + [EOS_ID]
            group.append({"token_ids": ids, "logprobs": [-1.0] * len(ids), "finish_reason": "stop"})
        completions.append(group)
    per_prompt = eval_cli.score(task, codec, prompts, requests, completions, timeout_s=0.0)
    assert [p["rewards"] for p in per_prompt] == [
        [1.0, 0.0, 1.0, 0.0],
        [0.0, 0.0, 0.0, 0.0],
        [1.0, 0.0, 1.0, 1.0],  # "4<pad>4" hides a token: 0
    ]
    rows = {r["subset"]: r for r in eval_cli.summarize(per_prompt, [1, 2, 4], task.subjects())}
    assert rows["all"]["prompts"] == 3 and rows["add"]["prompts"] == 2
    for k in (1, 2, 4):
        want_all = (closed(4, 2, k) + closed(4, 0, k) + closed(4, 3, k)) / 3
        assert rows["all"][f"pass@{k}"] == pytest.approx(want_all, abs=1e-12)
        assert rows["add"][f"pass@{k}"] == pytest.approx(
            (closed(4, 2, k) + closed(4, 3, k)) / 2, abs=1e-12
        )
    assert rows["sub"]["pass@4"] == 0.0
    assert rows["all"]["accuracy"] == pytest.approx(rows["all"]["pass@1"])
    table = eval_cli.markdown(list(rows.values()))
    assert table.splitlines()[0].startswith("| subset | prompts | accuracy | pass@1 | pass@2")


def test_exactly_one_model_source(tmp_path):
    with pytest.raises(ValueError, match="exactly one"):
        eval_cli.resolve_model_dir("", "", str(tmp_path))
    with pytest.raises(ValueError, match="exactly one"):
        eval_cli.resolve_model_dir("a", "b", str(tmp_path))
