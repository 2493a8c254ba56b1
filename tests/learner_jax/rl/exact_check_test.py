"""The learner's exact check against an independent sampler (independent_sampler.py:
transformers logits, numpy truncation in vLLM's order and the seeded Gumbel-max choice);
the checker recomputes everything in JAX from the same HF weights and must pass every
honest token and refuse every group with a chosen one."""

import copy

import numpy as np
import pytest
import torch
from independent_sampler import LENGTH, N, hf_model, model_dir, peaked_weights
from independent_sampler import group as _group
from independent_sampler import sample as _sample

from bridge.contracts import exact_check, gumbel
from learner_jax.model import hf_import
from learner_jax.model.truncation import Truncation
from learner_jax.rl.exact_check import ExactChecker


@pytest.fixture(scope="module")
def peaked(tmp_path_factory):
    path = model_dir(str(tmp_path_factory.mktemp("peaked")), peaked_weights())
    cfg, params = hf_import.load_hf_params(path)
    return hf_model(path), cfg, params


_CHECKERS: dict = {}


def _checker(cfg, params, **kw):
    """One checker (one compile) per sampling setting for the whole module."""
    key = tuple(sorted(kw.items()))
    if key not in _CHECKERS:
        _CHECKERS[key] = ExactChecker(lambda v: params, cfg, rows_per_call=8, chunk=8, **kw)
    return _CHECKERS[key]


def test_honest_tokens_pass_and_a_written_sample_refuses_its_group(peaked):
    hf, cfg, params = peaked
    seed = 123456789012345
    honest = [_sample(hf, seed, i) for i in range(N)]
    written = list(honest)
    written[2] = [int(c) for c in (np.arange(LENGTH) * 7 + 3) % 100]  # its own text
    other = gumbel.draw_seed()
    verdict = _checker(cfg, params, temperature=1.0).check(
        [_group(1, seed, honest), _group(2, seed, written, worker="cheat"),
         _group(3, other, [_sample(hf, other, i) for i in range(N)])]
    )  # fmt: skip
    assert verdict.refused == {2}
    by = {s.worker_id: s for s in verdict.stats}
    assert by["w1"].exact_tokens == 2 * N * LENGTH and by["w1"].exact_mismatches == 0
    assert by["cheat"].exact_mismatches >= LENGTH // 2
    # the honest gaps are float noise only (fp64 sampler, fp32 checker): no flips
    assert verdict.metrics["exact/flipped_tokens"] == 0


def test_the_seed_is_what_is_checked(peaked):
    hf, cfg, params = peaked
    seed = 42
    shifted = [_sample(hf, seed + 1, i) for i in range(N)]  # sampled, but not with its seed
    assert shifted != [_sample(hf, seed, i) for i in range(N)]
    verdict = _checker(cfg, params, temperature=1.0).check([_group(1, seed, shifted)])
    assert verdict.refused == {1}
    # a group the controller has no seed for cannot be verified
    unseeded = _checker(cfg, params, temperature=1.0).check([_group(2, -1, shifted)])
    assert unseeded.refused == {2}


def test_a_cooler_sampler_and_a_greedy_picker_are_caught(peaked):
    hf, cfg, params = peaked
    seed = 7
    cool = [_sample(hf, seed, i, temperature=0.9) for i in range(N)]
    greedy = [_sample(hf, seed, i, chooser=lambda z, g: int(np.argmax(z))) for i in range(N)]
    checker = _checker(cfg, params, temperature=1.0)
    verdict = checker.check([_group(1, seed, cool), _group(2, seed, greedy)])
    assert verdict.refused == {1, 2}
    # declared bf16, the cooler sampler hides in the margin's slack at some positions: the
    # tokens it chose there are counted as flips, far above an honest engine's rate
    half = checker.check([_group(3, seed, cool, dtype="bfloat16")])
    bad, flips = half.metrics["exact/mismatched_tokens"], half.metrics["exact/flipped_tokens"]
    assert bad + flips >= 0.05 * half.metrics["exact/checked_tokens"]


def test_truncation_is_the_samplers_in_its_order(peaked):
    hf, cfg, params = peaked
    trunc = dict(top_k=6, top_p=0.5, min_p=0.05)
    checker = _checker(cfg, params, temperature=0.7, truncation=Truncation(**trunc))
    seeds = [11, 12]
    honest = [_group(s, s, [_sample(hf, s, i, 0.7, **trunc) for i in range(N)]) for s in seeds]
    assert checker.check(honest).refused == set()
    # top-p before top-k keeps other tokens: some group shows it
    swapped = [
        _group(s, s, [_sample(hf, s, i, 0.7, order=("min_p", "top_p", "top_k"), **trunc)
                      for i in range(N)])
        for s in seeds
    ]  # fmt: skip
    untruncated = [_group(s, s, [_sample(hf, s, i, 0.7) for i in range(N)]) for s in seeds]
    assert checker.check(untruncated).refused
    assert checker.check(swapped).refused


def test_multi_turn_checks_the_models_tokens_only_and_every_version(peaked):
    hf, cfg, params = peaked
    seed = 99
    rows = [_sample(hf, seed, i) for i in range(2)]
    # tokens 4..6 are the environment's: anything goes there, and the model's later tokens
    # were sampled after them (positions continue through them)
    mask = [1] * 4 + [0] * 3 + [1] * (LENGTH - 7)
    env = [_sample(hf, seed, i, prefix=rows[i][:4] + [90, 91, 92]) for i in range(2)]
    checker = _checker(cfg, params, temperature=1.0)
    verdict = checker.check([_group(1, seed, env, mask=mask)])
    assert verdict.refused == set()
    assert verdict.metrics["exact/checked_tokens"] == 2 * (LENGTH - 3)
    # a swap mid-generation: tokens 6.. sampled by version 1 (a sharper final norm), each
    # token checked under the version it is tagged with
    two = {0: params, 1: dict(params, final_norm={"scale": params["final_norm"]["scale"] * 3})}
    hf1 = copy.deepcopy(hf)
    with torch.no_grad():
        hf1.model.norm.weight.mul_(3)
    swapped = [rows[i][:6] + _sample(hf1, seed, i, prefix=rows[i][:6])[6:] for i in range(2)]
    assert swapped != rows
    mixed = ExactChecker(two.__getitem__, cfg, temperature=1.0, rows_per_call=8, chunk=8)
    tags = [0] * 6 + [1] * (LENGTH - 6)
    assert mixed.check([_group(2, seed, swapped, versions=tags)]).refused == set()
    assert mixed.check([_group(3, seed, swapped, versions=[0] * LENGTH)]).refused == {3}
    assert mixed.check([_group(4, seed, rows, versions=tags)]).refused == {4}


def test_mismatches_and_flips_follow_the_margin():
    gaps = np.array([[0.0, 1e-4, 0.05, 0.2, 0.2, np.inf, np.nan]])
    scales = np.array([[1.0, 1.0, 1.0, 1.0, 10.0, 1.0, 1.0]])  # margin 0.07 or 0.52
    bad, flips = exact_check.classify(gaps, scales, np.ones_like(gaps), 0.02, 0.05)
    assert bad.tolist() == [3] and flips.tolist() == [2]
    bad, flips = exact_check.classify(gaps, scales, np.array([[1, 1, 1, 0, 0, 0, 0]]))
    assert bad.tolist() == [0] and flips.tolist() == [1]
