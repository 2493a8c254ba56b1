"""The verifiable sampler draws exactly the contract's Gumbel-max token, checked from outside.

The torch noise equals bridge/contracts/gumbel.py's bit for bit. Real vLLM generation
(the session engine, which installs the sampler) is then checked the way the learner will
check it: the processed logits z are recomputed independently (transformers, float32, then
temperature, min-p, top-k, top-p in numpy in vLLM's order) and the noise g by the numpy
contract with key seed + sample index at each token's absolute position; every sampled token
must be argmax(z + g) up to `MARGIN` (engine vs transformers float32 numerics).
"""

import numpy as np
import pytest
import torch

from bridge.contracts import gumbel as G
from bridge.model import tiny_model
from rollout_gpu import verifiable_sampler as vs
from rollout_gpu.engine import SampleRequest

# The engine and transformers compute the tiny model's logits in float32 along different
# kernels; they differ by a few float32 ulps of the accumulated sums (measured: max
# |reported - transformers| log-prob 5e-7). The engine's draw is the argmax of z' + g with
# z' = z + e, so under z it misses the argmax by at most 2 max|e| / T (~1.5e-6 here, plus
# float32 rounding of z + g, < 1e-6); measured gap: exactly 0 on every token. A wrong draw
# misses by a Gumbel difference, O(1) (every wrong key or position below: > 0.05). 1e-4
# leaves ~50x headroom over the numerics and is far below a wrong draw's gap.
MARGIN = 1e-4


def test_torch_noise_equals_numpy_bits():
    rng = np.random.default_rng(0)
    rows, vocab = 64, 4099
    seeds = [int(s) for s in rng.integers(0, G.SEED_LIMIT, rows)]
    seeds[:3] = [0, 1, G.SEED_LIMIT - 1]  # the extremes of both key words
    index = rng.integers(0, 16, rows)
    pos = rng.integers(0, 1 << 31, rows)
    words = np.array([G.key_words(s, int(i)) for s, i in zip(seeds, index, strict=True)])
    want = G.noise_bits(G.position_base(words[:, 0], words[:, 1], pos), G.token_terms(vocab))
    base = vs.key_bases([s + int(i) for s, i in zip(seeds, index, strict=True)], pos)
    got = vs.noise_bits(base, vs.token_terms(vocab)).numpy()
    assert got.dtype == np.int64 and got.min() >= 0 and got.max() < 1 << 32
    assert np.array_equal(got, want.astype(np.int64)), (got != want).mean()
    noise = vs.gumbel_from_bits(torch.from_numpy(got)).numpy().astype(np.float64)
    ref = G.gumbel_from_bits(want)
    # float32 logs of u in (2^-24, 1): each rounding is 2^-24 relative, so |Δg| stays within
    # a few 1e-7 of max(|g|, 1) (g near 0 where log u ~ -1).
    assert np.max(np.abs(noise - ref) / np.maximum(np.abs(ref), 1.0)) < 1e-5


def test_fused_kernel_picks_numpy_argmax():
    """The compiled kernel (what the engine runs) picks argmax(z + g) of the numpy noise."""
    rng = np.random.default_rng(1)
    rows, vocab = 33, 5003
    assert vs.compile_kernel(vocab, "cpu")
    seeds = [int(s) for s in rng.integers(0, G.SEED_LIMIT, rows)]
    pos = rng.integers(0, 4096, rows)
    z = rng.standard_normal((rows, vocab)).astype(np.float32) * 3
    z[:, rng.integers(0, vocab, 500)] = -np.inf  # truncated tokens
    tokens = vs.gumbel_argmax(
        torch.from_numpy(z), vs.key_bases(seeds, pos), vs.token_terms(vocab)
    ).numpy()
    lo, hi = (np.array([G.key_words(s, 0)[j] for s in seeds]) for j in (0, 1))
    noise = G.gumbel(lo, hi, pos, vocab)
    gaps = G.gap(z.astype(np.float64), noise, tokens)
    # float32 z + g vs float64: |z + g| < 30, so each score is off by < 30 * 2^-23.
    assert gaps.max() <= 1e-5, gaps.max()
    assert G.gap(z.astype(np.float64), noise[::-1], tokens).max() > 0.05  # other keys


def test_draws_follow_softmax():
    """argmax(z + g) over many positions of one key samples softmax(z): each token's count
    is within 5 binomial standard deviations of its expectation."""
    z = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -np.inf, -3.0], dtype=torch.float32)
    draws_n = 100_000
    base = vs.key_bases([123] * draws_n, np.arange(draws_n))
    tokens = vs.gumbel_argmax(z.expand(draws_n, -1).contiguous(), base, vs.token_terms(7))
    counts = np.bincount(tokens.numpy(), minlength=7)
    p = torch.softmax(z.double(), -1).numpy()
    assert counts[5] == 0  # a dropped token is never drawn
    sd = np.sqrt(draws_n * p * (1 - p))
    assert np.all(np.abs(counts - draws_n * p) <= 5 * sd + 1e-9), (counts, draws_n * p)


# -- real generation, checked independently ------------------------------------------------


@pytest.fixture(scope="module")
def hf_logits(tiny_model_dir):
    """tokens -> float64 [len, V]: transformers' float32 logits of the tiny Qwen3."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def logits(tokens):
        with torch.no_grad():
            return model(torch.tensor([list(tokens)])).logits[0].double().numpy()

    return logits


def log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def processed(logits, r: SampleRequest):
    """z [A, V]: vLLM's processing of raw logits (Sampler.sample, apply_top_k_top_p_pytorch)
    transcribed to numpy: temperature, min-p, top-k, top-p; dropped tokens -inf."""
    if r.temperature == 0:  # greedy: vLLM takes the plain argmax of the logits
        return logits
    z = logits / r.temperature
    if r.min_p > 0:
        probs = np.exp(log_softmax(z))
        z = np.where(probs < r.min_p * probs.max(-1, keepdims=True), -np.inf, z)
    if r.top_k > 0:
        kth = np.sort(z, -1)[:, -r.top_k][:, None]
        z = np.where(z < kth, -np.inf, z)
    if r.top_p < 1:
        order = np.argsort(z, -1, kind="stable")
        ascending = np.take_along_axis(z, order, -1)
        cumulative = np.cumsum(np.exp(log_softmax(ascending)), -1)
        drop = cumulative <= 1 - r.top_p
        drop[:, -1] = False
        z = np.empty_like(ascending)
        np.put_along_axis(z, order, np.where(drop, -np.inf, ascending), -1)
    return z


def draws(hf_logits, r: SampleRequest, sample):
    """(z [A, V], tokens [A], absolute positions [A]) of one completion."""
    prompt, tokens = list(r.prompt_token_ids), list(sample.token_ids)
    logits = hf_logits(prompt + tokens)[len(prompt) - 1 : len(prompt) + len(tokens) - 1]
    positions = np.arange(len(prompt), len(prompt) + len(tokens))
    return processed(logits, r), np.asarray(tokens), positions


def gaps(hf_logits, r: SampleRequest, sample, key=None, position_offset=0):
    """Each token's gap to argmax(z + g) with the contract's noise: key seed + index."""
    z, tokens, positions = draws(hf_logits, r, sample)
    if r.temperature == 0:
        return G.gap(z, None, tokens)
    lo, hi = G.key_words(r.seed if key is None else key, sample.index)
    noise = G.gumbel(lo, hi, positions + position_offset, z.shape[-1])
    return G.gap(z, noise, tokens)


def prompt(seed, length=6):
    rng = np.random.default_rng(seed)
    return [tiny_model.BOS_ID] + rng.integers(3, 90, length - 1).tolist()


T1 = SampleRequest(prompt(0), n=3, temperature=1.0, max_tokens=24, seed=12345)
TRUNC = SampleRequest(
    prompt(1), n=3, temperature=0.7, top_k=20, top_p=0.9, min_p=0.3, max_tokens=24,
    seed=(1 << 61) + 7,  # a key with a nonzero high word
)  # fmt: skip
GREEDY = SampleRequest(prompt(2), n=1, temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def generated(vllm_engine):
    assert vllm_engine.verifiable
    requests = [T1, TRUNC, GREEDY]
    return list(zip(requests, vllm_engine.generate(requests), strict=True))


@pytest.mark.vllm
def test_every_sampled_token_is_the_gumbel_argmax(generated, hf_logits):
    worst, closest, count = 0.0, np.inf, 0
    for r, samples in generated:
        assert len(samples) == r.n
        for sample in samples:
            assert len(sample.token_ids) >= 4
            g = gaps(hf_logits, r, sample)
            worst, count = max(worst, float(g.max())), count + len(g)
            assert g.max() <= MARGIN, (r, sample.index, g)
            if r.temperature > 0:  # how close the nearest runner-up came (informative)
                z, tokens, positions = draws(hf_logits, r, sample)
                noise = G.gumbel(*G.key_words(r.seed, sample.index), positions, z.shape[-1])
                top2 = np.sort(z + noise, -1)[:, -2:]
                closest = min(closest, float((top2[:, 1] - top2[:, 0]).min()))
    print(f"{count} tokens: largest gap {worst:.2e}, closest runner-up {closest:.2e}")


@pytest.mark.vllm
def test_truncation_reaches_the_check(generated, hf_logits):
    """The truncated case truly drops tokens (so z's -inf entries matter): under the
    untruncated tempered logits some draws are not the argmax."""
    r, samples = generated[1]
    loose = SampleRequest(r.prompt_token_ids, n=r.n, temperature=r.temperature, seed=r.seed)
    worst = max(gaps(hf_logits, loose, s).max() for s in samples)
    assert worst > 0.05, worst


@pytest.mark.vllm
def test_wrong_key_or_position_is_caught(generated, hf_logits):
    for r, samples in generated[:2]:
        for sample in samples:
            assert gaps(hf_logits, r, sample, key=r.seed + 1000).max() > 0.05
            assert gaps(hf_logits, r, sample, position_offset=1).max() > 0.05
            assert gaps(hf_logits, r, sample, position_offset=-1).max() > 0.05
        # child i's key is seed + i: samples 1, 2 checked with sample 0's key fail
        for sample in samples[1:]:
            z, tokens, positions = draws(hf_logits, r, sample)
            noise = G.gumbel(*G.key_words(r.seed, 0), positions, z.shape[-1])
            assert G.gap(z, noise, tokens).max() > 0.05


@pytest.mark.vllm
def test_seed_fixes_the_tokens(vllm_engine, generated):
    r, first = generated[0]
    other = SampleRequest(r.prompt_token_ids, n=r.n, temperature=1.0, max_tokens=24, seed=99)
    again, reseeded = vllm_engine.generate([r, other])
    assert [s.token_ids for s in again] == [s.token_ids for s in first]
    assert all(a.token_ids != b.token_ids for a, b in zip(first, reseeded, strict=True))
    unseeded = SampleRequest(r.prompt_token_ids, n=2, temperature=1.0, max_tokens=24)
    a, b = vllm_engine.generate([unseeded, unseeded])
    assert len({tuple(s.token_ids) for s in a + b}) == 4  # fresh keys each time


@pytest.mark.vllm
def test_continuation_keeps_counting_positions(vllm_engine, generated, hf_logits):
    """A later turn's prompt holds the earlier turns: its tokens sit at positions after them,
    with the same key (an episode's sample i keeps seed + i every turn)."""
    r, samples = generated[0]
    history = list(r.prompt_token_ids) + list(samples[0].token_ids) + prompt(7, 4)[1:]
    turn = SampleRequest(history, n=1, temperature=1.0, max_tokens=16, seed=r.seed)
    (sample,) = vllm_engine.generate([turn])[0]
    assert gaps(hf_logits, turn, sample).max() <= MARGIN
    # counted from the turn's own start instead, the check fails
    assert gaps(hf_logits, turn, sample, position_offset=-len(history)).max() > 0.05


@pytest.mark.vllm
def test_reported_logprobs_are_the_policys(generated, hf_logits):
    worst = 0.0
    for r, samples in generated[:2]:
        for sample in samples:
            z, tokens, positions = draws(hf_logits, r, sample)
            got = np.asarray(sample.logprobs)
            want = np.take_along_axis(log_softmax(z), tokens[:, None], -1)[:, 0]
            noise = G.gumbel(*G.key_words(r.seed, sample.index), positions, z.shape[-1])
            noised = np.take_along_axis(log_softmax(z + noise), tokens[:, None], -1)[:, 0]
            worst = max(worst, float(np.abs(got - want).max()))
            # log-probs of magnitude ~5: float32 rounding ~1e-6, engine numerics ~1e-6
            assert np.abs(got - want).max() <= 1e-4, np.abs(got - want).max()
            assert np.abs(got - noised).max() > 0.1
    print(f"largest |reported - transformers| log-prob: {worst:.2e}")


@pytest.mark.vllm
def test_seeded_requests_survive_a_chunked_prefill(vllm_engine):
    """Prompts that together exceed one engine step's token budget are prefilled in chunks.
    Keyed through vLLM's own `SamplingParams.seed`, vLLM's CPU backend raised on that
    ("CPU Generator does not use offset") and the worker died: a holdem run lost a worker
    per lease. Each sample still follows its own key: the same requests give the same
    tokens, and the batch order does not change any sample's tokens."""
    budget = vllm_engine.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
    length = 200
    count = budget // length + 2
    requests = [
        SampleRequest(prompt(100 + i, length), n=2, temperature=1.0, max_tokens=4, seed=7 * i)
        for i in range(count)
    ]
    first = vllm_engine.generate(requests)
    assert [len(samples) for samples in first] == [2] * count
    again = vllm_engine.generate(requests[::-1])[::-1]
    assert [[s.token_ids for s in r] for r in again] == [[s.token_ids for s in r] for r in first]
