"""The learner's KV-cache decoder (learner_jax/model/kv_decode.py) emits exactly the tokens of the
cache-free reference (`evaluate.full_forward_fn`: the full forward at every step), greedy
and sampled from the same key, on the tiny models of every family (Qwen3 q/k-norm + tied
head, Qwen2 q/k/v bias, Llama untied head, Qwen3-MoE routed experts), with left-padded
prompts of different lengths; and it stops at EOS.

The tiny models' random weights (std 0.02) give near-uniform logits and the same greedy
token everywhere; every weight except the norm scales is multiplied by 8 so the answers
depend on the prompt and on earlier answer tokens (masks and positions matter)."""

import jax
import numpy as np
import pytest

from bridge import tasks
from bridge.contracts.prompt import TextCodec
from bridge.model import tiny_model
from learner_jax.evaluation import evaluate
from learner_jax.model import hf_import, kv_decode, sharding

NEW = 24
PROMPT = 16


@pytest.fixture(scope="module", params=["qwen3", "qwen2", "llama", "qwen3_moe"])
def family(request, tiny_model_dirs, tmp_path_factory):
    if request.param == "qwen3_moe":
        path = str(tmp_path_factory.mktemp("tiny_moe"))
        return _load(tiny_model.make_tiny_model(path, tiny_model.tiny_config("qwen3_moe")))
    return _load(tiny_model_dirs[request.param])


@pytest.fixture(scope="module")
def qwen3(tiny_model_dirs):
    return _load(tiny_model_dirs["qwen3"])


def _load(model_dir):
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    cfg, params = hf_import.load_hf_params(model_dir, mesh)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x if "scale" in jax.tree_util.keystr(path) else x * 8, params
    )
    return cfg, params, mesh, TextCodec(model_dir)


def _ids(cfg, params, mesh, codec, **eval_kw):
    task = tasks.make_task("arithmetic", eval_size=12)
    ev = evaluate.Evaluator(cfg, codec, task, evaluate.EvalConfig(PROMPT, NEW, **eval_kw))
    return ev.completion_ids(params, mesh)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cached_equals_cache_free(family, temperature):
    cfg, params, mesh, codec = family
    got = _ids(cfg, params, mesh, codec, temperature=temperature)
    want = _ids(cfg, params, mesh, codec, temperature=temperature, kv_cache=False)
    assert len(got) == 12
    assert got == want
    # Not vacuous: the answers are long and not all alike.
    assert sum(map(len, got)) >= 12 * 4 and len({tuple(x) for x in got}) > 1


def test_sampling_depends_on_the_key(qwen3):
    cfg, params, mesh, codec = qwen3
    a = _ids(cfg, params, mesh, codec, temperature=1.0, seed=0)
    b = _ids(cfg, params, mesh, codec, temperature=1.0, seed=1)
    assert a != b


def test_stops_at_eos_and_pads_after(qwen3):
    cfg, params, mesh, codec = qwen3
    # Greedy prefix of one prompt, then ask again with EOS = the 3rd token it emits: the
    # decoder must stop there and fill the rest with pad.
    ids = codec.encode_prompt("12+34=")
    prompts = np.full((8, PROMPT), codec.pad_id, np.int32)
    seg = np.zeros((8, PROMPT), np.int32)
    prompts[:, PROMPT - len(ids) :], seg[:, PROMPT - len(ids) :] = ids, 1
    key = jax.random.key(0)
    free = kv_decode.decode_fn(cfg, PROMPT, NEW, pad_id=codec.pad_id)
    with sharding.use_mesh(mesh, sharding.DEFAULT_RULES):
        full = np.asarray(free(params, prompts, seg, key))
        stop = int(full[0, 2])
        cut = kv_decode.decode_fn(cfg, PROMPT, NEW, eos_id=stop, pad_id=-7)
        out = np.asarray(cut(params, prompts, seg, key))
    first = list(full[0]).index(stop)
    assert (out[:, : first + 1] == full[:, : first + 1]).all()
    assert (out[:, first + 1 :] == -7).all()


def test_negative_temperature_refused(qwen3):
    cfg = qwen3[0]
    with pytest.raises(ValueError, match="temperature"):
        kv_decode.decode_fn(cfg, PROMPT, NEW, temperature=-1.0)
    with pytest.raises(ValueError, match="temperature"):
        evaluate.EvalConfig(PROMPT, NEW, temperature=-0.5)


def test_n_samples_per_prompt_and_pass_at_k(qwen3, tiny_model_dirs):
    """`eval.n` samples per prompt at `eval.temperature`: the summary's accuracy, pass@1
    and pass@k are the task's rewards on those samples, per prompt (closed form on the
    counts); greedy asks for one sample whatever n; and the run config's eval section
    reaches the learner's evaluator."""
    import dataclasses

    from ml_collections import ConfigDict

    from bridge.contracts import pass_at_k
    from learner_jax import run_config

    cfg, params, mesh, codec = qwen3
    task = tasks.make_task("arithmetic", eval_size=4, strict=True)
    sampling = evaluate.EvalConfig(PROMPT, 6, temperature=1.0, n=3)
    ids = evaluate.Evaluator(cfg, codec, task, sampling).completion_ids(params, mesh)
    assert len(ids) == 12 and len({tuple(x) for x in ids}) > 4  # samples differ
    # The random model never solves arithmetic: make sample 0 of prompt 0 and sample 1 of
    # prompt 1 "right" (same key, same samples), so the counts are not all zero.
    right = {0: codec.decode(ids[0]).strip(), 1: codec.decode(ids[4]).strip()}
    prompts = [dataclasses.replace(p, answer=right.get(i, p.answer))
               for i, p in enumerate(task.eval_prompts())]  # fmt: skip
    task.eval_prompts = lambda: prompts
    ev = evaluate.Evaluator(cfg, codec, task, sampling)
    assert ev.completion_ids(params, mesh) == ids
    counts = []
    for i, p in enumerate(prompts):
        right = sum(tasks.score(task, p, codec.decode(x)) >= 1 for x in ids[3 * i : 3 * i + 3])
        counts.append((3, right))
    assert counts[0][1] >= 1 and counts[1][1] >= 1 and counts[2][1] == counts[3][1] == 0
    got = ev.summary(params, mesh)
    assert got["eval/accuracy"] == sum(c for _, c in counts) / 12
    assert got["eval/pass@k"] == pass_at_k.mean_pass_at_k(counts, 3)
    assert got["eval/pass@1"] == pytest.approx(got["eval/accuracy"])
    assert got["eval/mean_length"] == np.mean([len(x) for x in ids])
    assert evaluate.EvalConfig(PROMPT, 6, temperature=0.0, n=5).samples == 1
    config = ConfigDict({"batch": {"max_prompt_len": PROMPT, "max_answer_len": 6},
                         "eval": {"temperature": 0.7, "n": 2}, "seed": 3,
                         "model": {"dtype": "float32", "hf_dir": ""}})  # fmt: skip
    e = run_config.eval_config(config)
    assert (e.temperature, e.n, e.seed, e.samples) == (0.7, 2, 3, 2)
