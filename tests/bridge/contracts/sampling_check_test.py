"""The likelihood test of sampled tokens (bridge/contracts/sampling_check.py; issue 23 item
6) on real next-token distributions of a tiny random model (transformers, float64
log-softmax): honest sampling stays within Z_MAX at every look for every simulated honest
worker (the measured false-positive count), while workers that pick tokens themselves
(greedy, the likeliest of 4 samples, a reference text the policy would not say) are past
it within a few groups."""

import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM

from bridge.contracts import sampling_check as sc
from bridge.model import tiny_model

GROUP_ROWS, ROW_TOKENS, GROUPS = 4, 16, 12


def _distributions(tmp_path):
    """[N, V] float64 log-prob rows: the tiny model's next-token distributions after random
    prefixes (the shapes an audit sees: some peaked, some flat)."""
    cfg = tiny_model.tiny_config("qwen3", num_layers=2)
    tiny_model.make_tiny_model(str(tmp_path), cfg)
    weights = tiny_model.random_hf_weights(cfg, seed=3, std=0.2)
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = torch.tensor(np.random.default_rng(0).integers(1, 99, size=(64, 32)))
    with torch.no_grad():
        logits = hf(input_ids=ids).logits.double()
    return torch.log_softmax(logits, -1).reshape(-1, logits.shape[-1]).numpy()


def _worker(pool, rng, pick, row_tokens=ROW_TOKENS):
    """Per-group Z and evidence CUSUM of one worker: `pick(logp_rows [T, V]) -> token ids
    [T]` per row; every look after a group is a test (sequential), as the audit would run
    it (one stat per group)."""
    entropy, variance = sc.position_moments(pool)
    collision = sc.log_collision(pool)
    dev = var = cusum = 0.0
    zs, cusums = [], []
    for _ in range(GROUPS):
        evidence = 0.0
        for _ in range(GROUP_ROWS):
            at = rng.integers(len(pool), size=row_tokens)
            tokens = pick(pool[at], rng)
            s = pool[at, tokens][None]
            mask = np.ones_like(s)
            d, v, _ = sc.row_sums(s, entropy[at][None], variance[at][None], mask)
            dev, var = dev + float(d[0]), var + float(v[0])
            evidence += float(sc.row_evidence(s, collision[at][None], mask)[0])
        cusum = max(0.0, cusum + evidence)
        zs.append(sc.z_score(dev, var))
        cusums.append(cusum)
    return np.array(zs), np.array(cusums)


def honest(rows, rng):
    """Sampled from the rows' distributions (inverse CDF)."""
    cdf = np.cumsum(np.exp(rows), axis=-1)
    u = rng.random(len(rows)) * cdf[:, -1]
    return np.minimum((cdf < u[:, None]).sum(axis=-1), rows.shape[-1] - 1)


def greedy(rows, rng):
    return rows.argmax(axis=-1)


def best_of_4(rows, rng):
    """Four honest samples of the row, the likeliest one reported (best-of-n by score)."""
    draws = [honest(rows, rng) for _ in range(4)]
    return max(draws, key=lambda t: rows[np.arange(len(t)), t].sum())


def reference(rows, rng):
    """A fixed text the policy did not choose: ids of a reference answer, here uniform."""
    return rng.integers(1, 99, size=len(rows))


def test_honest_workers_pass_and_token_pickers_are_caught(tmp_path):
    pool = _distributions(tmp_path)
    finals, worst, worst_evidence = [], 0.0, 0.0
    for w in range(200):  # 200 honest workers x 12 looks each
        z, cusum = _worker(pool, np.random.default_rng(100 + w), honest)
        finals.append(z[-1])
        worst = max(worst, float(np.abs(z).max()))
        worst_evidence = max(worst_evidence, float(cusum.max()))
    assert worst < sc.Z_MAX, worst  # measured: 0 false positives in 2,400 looks
    # The evidence CUSUM's bound is Lorden's (mean stats to a false alarm >= e^23); these
    # honest workers stay far below it (measured worst: see the print).
    assert worst_evidence < sc.EVIDENCE_MAX / 2, worst_evidence
    finals = np.array(finals)
    assert abs(finals.mean()) < 0.25 and 0.8 < finals.std() < 1.25, (finals.mean(), finals.std())
    caught_after = {}
    for name, pick in (("greedy", greedy), ("best_of_4", best_of_4), ("reference", reference)):
        z, _ = _worker(pool, np.random.default_rng(7), pick)
        past = np.flatnonzero(np.abs(z) > sc.Z_MAX)
        assert len(past), (name, z)
        caught_after[name] = int(past[0]) + 1  # groups of 4 x 16 tokens
    assert max(caught_after.values()) <= GROUPS, caught_after
    # A picker answering one token per row (4 tokens a group): Z may not judge before
    # audit_min_tokens (256 tokens = 64 groups); the evidence test needs a few groups.
    _, cusum = _worker(pool, np.random.default_rng(7), greedy, row_tokens=1)
    past = np.flatnonzero(cusum >= sc.EVIDENCE_MAX)
    assert len(past) and past[0] + 1 <= 8, cusum
    caught_after["greedy_1_token_rows_by_evidence"] = int(past[0]) + 1
    m, sd = finals.mean(), finals.std()
    print(
        f"honest final z: mean {m:.3f} std {sd:.3f}, worst |z| {worst:.2f}, worst evidence "
        f"{worst_evidence:.2f}; caught: {caught_after}"
    )


def test_evidence_is_a_likelihood_ratio_under_honest_sampling(tmp_path):
    """E_p[exp(e)] = 1 exactly at every position (what makes the CUSUM's bound hold), in
    float64 over the tiny model's real distributions, and dropped (-inf) tokens add 0."""
    pool = _distributions(tmp_path)[:200]
    collision = sc.log_collision(pool)
    p = np.exp(pool)
    mean_e = (p * np.exp(pool - collision[:, None])).sum(axis=-1)
    assert np.allclose(mean_e, 1.0, rtol=1e-9, atol=0), mean_e
    cut = pool.copy()
    cut[:, 64:] = -np.inf  # a truncated distribution (renormalized below)
    cut -= np.log(np.exp(cut).sum(axis=-1, keepdims=True))
    mean_cut = (
        np.exp(cut) * np.exp(np.where(np.isinf(cut), -np.inf, cut - sc.log_collision(cut)[:, None]))
    ).sum(-1)
    assert np.allclose(mean_cut, 1.0, rtol=1e-9, atol=0)
