"""reasoning-gym tasks end to end: seeded prompts, disjoint splits, prompt ids that rebuild
their item, strict scoring against reasoning-gym's own scorer, SFT examples."""

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bridge.tasks import Prompt, RewardError, cached_task, make_task, score
from bridge.tasks import reasoning_gym as rgt

pytest.importorskip("reasoning_gym")

ROOT = Path(__file__).resolve().parents[3]
OPTS = {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}


def _take(it, n):
    return list(itertools.islice(it, n))


@pytest.fixture(scope="module")
def task():
    # Options as a JSON string, the way a config flag delivers them.
    return make_task("reasoning_gym", dataset="chain_sum", dataset_options=json.dumps(OPTS))


def test_prompts_are_deterministic_per_seed(task):
    a = _take(task.train_prompts(0), 600)  # crosses a chunk boundary
    assert a == _take(
        make_task("reasoning_gym", dataset="chain_sum", dataset_options=OPTS).train_prompts(0), 600
    )
    assert a != _take(task.train_prompts(1), 600)
    assert len({p.prompt_id for p in a}) == 600
    assert all(p.text.startswith("State the final answer") and p.answer for p in a)


def test_splits_are_disjoint(task):
    ev = task.eval_prompts()
    assert len(ev) == 200 and ev == task.eval_prompts()
    held = {p.text for p in ev}
    # 1-digit chain sums are a small space: the raw streams do collide, the filter removes it.
    raw = _take(task._items("train", "train/0"), 2000)
    assert held & {p.text for p, _ in raw}
    for seed in (0, 1):
        train = _take(task.train_prompts(seed), 2000)
        assert not held & {p.text for p in train}
    assert {p.prompt_id.split("/")[2] for p in ev} == {"eval"}


def test_prompt_ids_rebuild_the_item(task):
    rgt._dataset.cache_clear()  # rebuild from scratch, not from the generator's cache
    for p in _take(task.train_prompts(3), 5) + task.eval_prompts()[:5]:
        assert rgt.prompt_from_id(p.prompt_id) == p
        assert task.prompt_from_id(p.prompt_id) == p
        entry = rgt.entry_from_id(p.prompt_id)
        assert entry["answer"] == p.answer and entry["metadata"]["source_dataset"] == "chain_sum"
    with pytest.raises(ValueError, match="not a reasoning_gym prompt id"):
        rgt.entry_from_id("arithmetic/train/3")


def test_a_fresh_process_rebuilds_the_same_prompt(task):
    p = _take(task.train_prompts(5), 1)[0]
    code = (
        "import sys; from bridge.tasks import reasoning_gym as r; "
        "print(r.prompt_from_id(sys.argv[1]).answer)"
    )
    out = subprocess.run([sys.executable, "-c", code, p.prompt_id], capture_output=True, text=True)
    assert out.stdout.strip() == p.answer, out.stderr


def test_strict_scores_agree_with_reasoning_gym_except_partial_credit(task):
    lenient = make_task(
        "reasoning_gym", dataset="chain_sum", dataset_options=OPTS, scoring="dataset"
    )
    for p in _take(task.train_prompts(0), 20):
        entry = rgt.entry_from_id(p.prompt_id)
        ds = rgt._dataset("chain_sum", rgt.canonical_options(OPTS), 0)
        for completion in (p.answer, f"think... <answer> {p.answer} </answer>"):
            assert score(task, p, completion) == 1.0 == score(lenient, p, completion)
            assert ds.score_answer(rgt.extract_answer(completion), entry) == 1.0
        padded = "1" + p.answer  # contains the answer: partial credit from reasoning-gym
        assert score(lenient, p, padded) == ds.score_answer(padded, entry) > 0
        assert score(task, p, padded) == 0.0


def test_17_against_7():
    t = make_task("reasoning_gym", dataset="chain_sum", dataset_options=OPTS, eval_size=1)
    p = next(q for q in t.train_prompts(0) if q.answer == "7")
    lenient = make_task(
        "reasoning_gym", dataset="chain_sum", dataset_options=OPTS, scoring="dataset", eval_size=1
    )
    assert score(lenient, p, "<answer>17</answer>") == 0.5
    assert score(t, p, "<answer>17</answer>") == 0.0
    assert score(t, p, "<answer>7</answer>") == 1.0
    assert score(t, p, "7.0") == 1.0  # chain_sum's scorer accepts it: full credit counts
    exact = make_task(
        "reasoning_gym", dataset="chain_sum", dataset_options=OPTS, scoring="exact", eval_size=1
    )
    assert score(exact, p, "7.0") == 0.0 and score(exact, p, " 7\n") == 1.0


def test_reward_uses_the_rebuilt_answer_not_the_prompts(task):
    p = task.eval_prompts()[0]
    forged = Prompt(p.prompt_id, p.text, "not the answer")
    assert score(task, forged, p.answer) == 1.0
    other = make_task("reasoning_gym", dataset="chain_sum", eval_size=1)
    with pytest.raises(RewardError, match="not from this task"):
        score(other, p, p.answer)


def test_datasets_without_a_single_answer_score_through_their_scorer():
    t = make_task("reasoning_gym", dataset="countdown", eval_size=2)
    p = t.eval_prompts()[0]
    entry = rgt.entry_from_id(p.prompt_id)
    # Any expression reaching the target counts; the reference is only one of them.
    assert score(t, p, f"<answer>{entry['answer']}</answer>") == 1.0
    assert score(t, p, "<answer>1 + 1</answer>") == 0.0


def test_sft_examples_and_options(task):
    prompts = _take(task.train_prompts(0), 3)
    assert _take(task.sft_examples(0), 3) == [
        (p.text, f"<answer>{p.answer}</answer>") for p in prompts
    ]
    with pytest.raises(ValueError, match="unknown reasoning-gym dataset"):
        make_task("reasoning_gym", dataset="nope")
    with pytest.raises(ValueError, match="rejects"):
        make_task("reasoning_gym", dataset="chain_sum", dataset_options={"min_terms": 0})
    with pytest.raises(ValueError, match="not JSON"):
        make_task("reasoning_gym", dataset="chain_sum", dataset_options="{min_terms")
    with pytest.raises(ValueError, match="may not set 'seed'"):
        make_task("reasoning_gym", dataset="chain_sum", dataset_options={"seed": 1})
    with pytest.raises(ValueError, match="scoring"):
        make_task("reasoning_gym", dataset="chain_sum", scoring="lenient")
    same = cached_task("reasoning_gym", task.options)
    assert same.eval_prompts() == task.eval_prompts()


def test_sloppy_teacher_swaps_the_first_two_letters_of_sft_answers_only():
    """task.sft_label_noise: that share of SFT answers has its first two characters swapped;
    the prompts, the held-out set and the reward stay exact."""
    opts = {"min_word_len": 3, "max_word_len": 5}
    clean = make_task("reasoning_gym", dataset="spell_backward", dataset_options=opts)
    sloppy = make_task(
        "reasoning_gym", dataset="spell_backward", dataset_options=opts, sft_label_noise=0.7
    )
    n = 1000
    prompts = _take(clean.train_prompts(0), n)
    swapped = 0
    for p, (text, target) in zip(prompts, _take(sloppy.sft_examples(0), n), strict=True):
        assert text == p.text
        habit = p.answer[1] + p.answer[0] + p.answer[2:]
        assert target in (f"<answer>{p.answer}</answer>", f"<answer>{habit}</answer>")
        if habit != p.answer:  # words whose last two letters are equal look the same
            swapped += target == f"<answer>{habit}</answer>"
            assert score(sloppy, p, f"<answer>{habit}</answer>") == 0.0
            assert score(sloppy, p, f"<answer>{p.answer}</answer>") == 1.0
    # 0.7 of ~960 distinguishable words: 4 binomial sds is +-0.06
    assert 0.64 < swapped / n < 0.76
    assert _take(clean.sft_examples(0), n) == [
        (p.text, f"<answer>{p.answer}</answer>") for p in prompts
    ]
    assert sloppy.eval_prompts() == clean.eval_prompts()
    with pytest.raises(ValueError, match="sft_label_noise"):
        make_task("reasoning_gym", dataset="spell_backward", sft_label_noise=1.5)


@pytest.mark.parametrize(
    "name",
    ["reasoning_gym_arith", "reasoning_gym_spell_backward", "reasoning_gym_spell_backward_sloppy"],
)
def test_config_prompts_and_answers_fit_the_batch(name, tiny_model_dir):
    """A shipped config's held-out prompts and SFT answers (+ EOS) fit its token budget
    under the character tokenizer: too long a prompt fails evaluation, and SFT cuts long
    rows silently, so its answers would lose their closing tag."""
    from bridge.contracts.prompt import TextCodec
    from learner_jax.config_file import load_config
    from learner_jax.train import make_task as task_from_config

    config = load_config(str(ROOT / "configs" / f"{name}.py"))
    t = task_from_config(config)
    codec = TextCodec(tiny_model_dir)
    b = config.batch
    for text, answer in [(p.text, f"<answer>{p.answer}</answer>") for p in t.eval_prompts()] + (
        _take(t.sft_examples(0), 500)
    ):
        assert len(codec.encode_prompt(text)) <= b.max_prompt_len, text
        assert len(codec.encode(answer)) + 1 <= b.max_answer_len, answer
        assert codec.decode(codec.encode(text)) == text  # every character is in the vocab
