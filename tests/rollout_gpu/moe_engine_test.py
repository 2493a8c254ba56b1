"""A tiny Qwen3-MoE on the real vLLM engine: routing recorded per token, hot swaps (full
and delta) with the canary, the verifiable sampler -- each checked against transformers'
float32 Qwen3MoeForCausalLM of the same weights.

Routing: the engine (float32) must record, for every forwarded position of every sample,
exactly the top-k experts transformers' router picks for the same token sequence; a
disagreement is allowed only where transformers' k-th and (k+1)-th router logits are
within `TIE` (float32 kernels may order a near-tie either way).
"""

import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from bridge.contracts import canary
from bridge.contracts import gumbel as G
from bridge.model import hf_files, tiny_model
from bridge.store.weight_store import WeightStore
from bridge.weights.delta_publisher import DeltaPublisher
from rollout_gpu import canary as engine_canary
from rollout_gpu import routing_capture, weight_swap
from rollout_gpu.engine import SampleRequest

pytestmark = pytest.mark.vllm

# Router logits are float32 sums of D = 64 products of O(0.1) terms: engine and transformers
# differ by ~1e-7 there. Two experts closer than 1e-4 may swap places; anything further
# apart is a different routing, not rounding.
TIE = 1e-4
# As the verifiable sampler's test: float32 engine vs transformers float32 logits differ by
# < 1e-6; a wrong draw misses by a Gumbel difference, O(1).
MARGIN = 1e-4


@pytest.fixture(scope="module")
def moe(tmp_path_factory, extra_vllm_engine):
    root = tmp_path_factory.mktemp("moe_engine")
    cfg = tiny_model.tiny_config("qwen3_moe")
    path = tiny_model.make_tiny_model(str(root / "v0"), cfg, seed=0)
    engine = extra_vllm_engine(path, dtype="float32", max_model_len=256, seed=0)
    assert engine.records_routing and engine.verifiable
    return engine, cfg, path, root


def hf_model(src_dir, root, name, weights=None):
    """transformers' float32 model of `weights` (HF names; None: the dir's own)."""
    from transformers import AutoModelForCausalLM

    path = str(root / name)
    if weights is not None:
        shutil.copytree(src_dir, path, dirs_exist_ok=True)
        save_file(weights, os.path.join(path, hf_files.SAFETENSORS), metadata={"format": "pt"})
    else:
        path = src_dir
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def ref_logprobs(model, token_lists):
    out = []
    with torch.no_grad():
        for ids in token_lists:
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].double(), -1)
            out.append(lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].numpy())
    return out


def prompt(seed, length=7):
    rng = np.random.default_rng(seed)
    return [tiny_model.BOS_ID] + rng.integers(3, 90, length - 1).tolist()


SEEDED = SampleRequest(prompt(0), n=3, temperature=1.0, max_tokens=12, seed=4242)
UNSEEDED = SampleRequest(prompt(1, 20), n=2, temperature=0.8, max_tokens=9)


@pytest.fixture(scope="module")
def generated(moe):
    engine = moe[0]
    requests = [SEEDED, UNSEEDED]
    return list(zip(requests, engine.generate(requests), strict=True))


def test_every_forwarded_position_has_the_routers_top_k(moe, generated):
    engine, cfg, path, root = moe
    model = hf_model(path, root, "v0")
    k, layers = cfg.num_experts_per_tok, cfg.moe_layers
    rows_checked = ties = 0
    for r, samples in generated:
        assert len(samples) == r.n
        for s in samples:
            seq = list(r.prompt_token_ids) + list(s.token_ids)
            rec = s.routed_experts
            # One row per forwarded position: the prompt's and each completion token's.
            assert rec.shape == (len(seq) - 1, len(layers), k), rec.shape
            assert (rec != routing_capture.MISSING).all()
            assert all(len(set(row)) == k for row in rec.reshape(-1, k).tolist())
            with torch.no_grad():
                out = model(torch.tensor([seq[:-1]]), output_router_logits=True)
            assert len(out.router_logits) == len(layers)
            for j, logits in enumerate(out.router_logits):
                top = torch.sort(logits.double(), -1, descending=True)
                want = top.indices[:, :k].numpy()
                near_tie = (top.values[:, k - 1] - top.values[:, k]).numpy() < TIE
                same = np.array([set(a) == set(b) for a, b in zip(want, rec[:, j], strict=True)])
                assert (same | near_tie).all(), (j, np.flatnonzero(~same))
                rows_checked += len(same)
                ties += int(near_tie.sum())
    assert rows_checked > 100
    print(f"{rows_checked} routing rows equal transformers' top-{k} ({ties} near-ties)")


def test_moe_tokens_are_the_verifiable_samplers_draws(moe, generated):
    engine, cfg, path, root = moe
    model = hf_model(path, root, "v0")
    r, samples = generated[0]
    wrong_key = []
    for s in samples:
        seq = list(r.prompt_token_ids) + list(s.token_ids)
        p, tokens = len(r.prompt_token_ids), np.asarray(s.token_ids)
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0].double().numpy()
        z = logits[p - 1 : len(seq) - 1] / r.temperature
        positions = np.arange(p, len(seq))
        noise = G.gumbel(*G.key_words(r.seed, s.index), positions, z.shape[-1])
        assert G.gap(z, noise, tokens).max() <= MARGIN
        other = G.gumbel(*G.key_words(r.seed + 1000, s.index), positions, z.shape[-1])
        wrong_key.append(G.gap(z, other, tokens).max())
    assert max(wrong_key) > 0.05  # the check can tell keys apart


def test_full_and_delta_swaps_pass_the_canary_and_equal_transformers(moe):
    """v1 replaces every tensor; v2 is a delta moving one expert of layer 1 only, so the
    reload replaces that layer's experts and must leave layer 0's packed experts alone."""
    engine, cfg, path, root = moe
    store = WeightStore(str(root / "store"))
    pub = DeltaPublisher(store, anchor_every=5, max_density=0.5)
    n_tok = len(engine.tokenizer)
    probes = canary.probe_token_lists(n_tok, tiny_model.BOS_ID)
    checks = canary.probe_token_lists(n_tok, tiny_model.BOS_ID, length=40, seed=7)
    current = weight_swap.EngineVersion()
    v1 = tiny_model.random_hf_weights(cfg, seed=5)
    v2 = dict(v1)
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    v2[name] = v1[name] + np.float32(0.3) * np.sign(v1[name])
    try:
        for version, weights in ((1, v1), (2, v2)):
            model = hf_model(path, root, f"v{version}", weights)
            extra = {"canary": canary.canary_payload(probes, ref_logprobs(model, probes))}
            manifest = pub.publish(
                version, version, weights.items(), cfg.to_hf_dict(), "float32", extra
            )
            assert manifest.is_full == (version == 1)
            result = weight_swap.load_version(engine, store, version, current)
            assert result is not None and result.ok, result
            got = engine_canary.engine_prompt_logprobs(engine, checks)
            want = ref_logprobs(model, checks)
            worst = max(float(np.abs(a - b).max()) for a, b in zip(got, want, strict=True))
            assert worst < 1e-5, (version, worst)
        # Routing is still recorded after swaps (the recorder survives reloads).
        [[s]] = engine.generate([SampleRequest(prompt(3), n=1, max_tokens=5, seed=1)])
        assert (s.routed_experts != routing_capture.MISSING).all()
    finally:
        weight_swap.restore(engine, weight_swap.EngineVersion())
