"""The exact expected reward of a policy on Kuhn poker, read off the Flax model, against an
independent computation: transformers' next-token distribution at each decision point's
token history, summed over every token the environment parses as each action."""

import jax
import numpy as np
import pytest

from bridge.contracts.prompt import TextCodec
from bridge.tasks import kuhn_poker, make_task
from learner_jax.evaluation import evaluate
from learner_jax.model import hf_import, sharding


def test_exact_expected_reward_matches_transformers(tiny_model_dir):
    import torch
    import transformers

    codec = TextCodec(tiny_model_dir)
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    cfg, params = hf_import.load_hf_params(tiny_model_dir, mesh)
    ev = evaluate.exact_evaluator(cfg, codec, make_task("kuhn_poker", turn_max_tokens=1))
    assert evaluate.exact_evaluator(cfg, codec, make_task("arithmetic")) is None
    # "c" and "C" both check: the action's probability sums both tokens.
    assert sorted(codec.decode([i]) for i in ev.action_ids["c"]) == ["C", "c"]

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    want = []
    for _, pieces in kuhn_poker.decision_points():
        ids = codec.encode_prompt(pieces[0])
        for text in pieces[1:]:
            ids += codec.encode(text)
        with torch.no_grad():
            p = torch.softmax(hf(torch.tensor([ids])).logits[0, -1].double(), -1).numpy()
        by_action = {}
        for t in range(len(p)):
            a = kuhn_poker.parse_action(codec.decode([t]))
            if a is not None:
                by_action[a] = by_action.get(a, 0.0) + p[t]
        want.append(by_action)
    got = ev.action_probs(params, mesh)
    for g, w in zip(got, want, strict=True):
        assert g.keys() == w.keys()
        np.testing.assert_allclose([g[a] for a in w], [w[a] for a in w], rtol=1e-4)
    exact = kuhn_poker.expected_reward(lambda c, h: want[kuhn_poker.INFO_SETS.index((c, h))])
    assert ev.expected_reward(params, mesh) == pytest.approx(exact, abs=1e-5)
    assert ev.optimum == pytest.approx(0.25)
