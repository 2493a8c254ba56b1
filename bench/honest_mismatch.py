"""How often an HONEST worker's token fails the exact check, or flips: a real vLLM engine
(bf16 by default) samples with the seeded sampler (rollout_gpu/verifiable_sampler.py), the
fp32 learner's checker (learner_jax/rl/exact_check.py) recomputes every token from the
same weights, and each token's gap is compared with the margin rule
(bridge/contracts/exact_check.py).

    python -m bench.honest_mismatch --out=/tmp/honest.json [--dtype=bfloat16 --std=0.2]

The model: the tiny Qwen3 architecture with random weights of std `--std` (0.02: nearly
flat next-token distributions over 128 tokens; 0.2: peaked, logits of a few units like a
trained model's), rounded to bf16 before either side loads them, as a published bf16
version is: the gap is the engine's activation numerics only. Reported: the gap
quantiles, the largest gap relative to the position's max |z| (what MARGIN_REL must
cover), the mismatch and flip rates under the default rule, and the one-sided
1 - `--confidence` Clopper-Pearson upper bound of each rate with the largest probability
(over any token count) that an honest identity reaches the quarantine rule at that bound.
bench/verify_cost.py reports `honest_mismatch_rate` from here.
"""

from __future__ import annotations

import json
import os
import tempfile

import ml_dtypes
import numpy as np
from absl import app, flags
from scipy import stats as scipy_stats

from bridge.contracts import exact_check


def upper_bound(hits: int, n: int, confidence: float) -> float:
    """One-sided Clopper-Pearson upper bound of a rate seen `hits` times in `n`."""
    return float(scipy_stats.beta.ppf(1 - confidence, hits + 1, max(n - hits, 1)))


def measure(model_dir: str, dtype: str = "bfloat16", groups: int = 32, n: int = 4,
            max_tokens: int = 32, temperature: float = 1.0, engine=None) -> dict:  # fmt: skip
    """Gaps of honest tokens: `groups` seeded requests of `n` samples each."""
    from bridge.contracts import gumbel
    from bridge.control.protocol import ConsumedGroup, Trajectory
    from learner_jax.model import hf_import
    from learner_jax.rl.exact_check import ExactChecker
    from rollout_gpu.engine import SampleRequest
    from rollout_gpu.vllm_engine import VllmEngine

    if engine is None:
        engine = VllmEngine.start(model_dir, dtype=dtype, max_model_len=256, seed=0)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, 100, size=8)) for _ in range(groups)]
    seeds = [gumbel.draw_seed() for _ in range(groups)]
    reqs = [SampleRequest(p, n=n, temperature=temperature, max_tokens=max_tokens, seed=s)
            for p, s in zip(prompts, seeds, strict=True)]  # fmt: skip
    outs = engine.generate(reqs)
    batch = []
    for gid, (p, s, samples) in enumerate(zip(prompts, seeds, outs, strict=True)):
        trajs = [
            Trajectory(prompt_id=str(gid), sample_index=c.index, prompt_token_ids=p,
                       completion_token_ids=c.token_ids, logprobs=c.logprobs,
                       versions=[0] * len(c.token_ids), finish_reason=c.finish_reason,
                       reward=0.0)
            for c in samples
        ]  # fmt: skip
        batch.append(
            ConsumedGroup(group_id=gid, prompt_id=str(gid), prompt="", answer="",
                          trajectories=trajs, worker_id="honest", sampling_seed=s)
        )  # fmt: skip
    cfg, params = hf_import.load_hf_params(model_dir)
    checker = ExactChecker(lambda v: params, cfg, temperature=temperature)
    gaps, scales = checker.gaps_of(batch)
    bad, flips = exact_check.classify(gaps[None], scales[None], np.ones((1, gaps.size)))
    return {
        "dtype": dtype,
        "tokens": int(gaps.size),
        "max_gap": float(gaps.max()) if gaps.size else 0.0,
        "max_gap_over_scale": float((gaps / np.maximum(scales, 1e-9)).max()) if gaps.size else 0.0,
        "scale_median": float(np.median(scales)) if gaps.size else 0.0,
        "gap_quantiles": {str(q): float(np.quantile(gaps, q)) for q in (0.5, 0.99, 0.999)},
        "margin": [exact_check.MARGIN_ABS, exact_check.MARGIN_REL],
        "mismatches": int(bad[0]),
        "flips": int(flips[0]),
        "honest_mismatch_rate": float(bad[0] / max(gaps.size, 1)),
        "honest_flip_rate": float(flips[0] / max(gaps.size, 1)),
    }


FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "JSON file for the results.", required=True)
flags.DEFINE_string("dtype", "bfloat16", "The engine's dtype (the learner checks in fp32).")
flags.DEFINE_integer("groups", 64, "Seeded requests.")
flags.DEFINE_integer("n", 4, "Samples per request.")
flags.DEFINE_integer("max_tokens", 32, "Tokens per sample.")
flags.DEFINE_float("std", 0.02, "Std of the tiny model's random weights.")
flags.DEFINE_float("confidence", 1e-3, "1 - the confidence of the rates' upper bounds.")


def main(argv):
    del argv
    from safetensors.numpy import save_file

    from bridge.model import tiny_model
    from rollout_gpu.vllm_engine import configure_cpu_process

    configure_cpu_process(1.0)
    with tempfile.TemporaryDirectory() as d:
        cfg = tiny_model.tiny_config("qwen3")
        tiny_model.make_tiny_model(d, cfg)
        weights = {
            k: v.astype(ml_dtypes.bfloat16).astype(np.float32)
            for k, v in tiny_model.random_hf_weights(cfg, seed=3, std=FLAGS.std).items()
        }
        save_file(weights, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        row = measure(d, FLAGS.dtype, FLAGS.groups, FLAGS.n, FLAGS.max_tokens)
    n = row["tokens"]
    for kind, tokens, fraction in (
        ("mismatch", exact_check.QUARANTINE_TOKENS, exact_check.QUARANTINE_FRACTION),
        ("flip", exact_check.FLIP_TOKENS, exact_check.FLIP_FRACTION),
    ):
        hits = row["mismatches" if kind == "mismatch" else "flips"]
        r_up = upper_bound(hits, n, FLAGS.confidence)
        row[f"{kind}_rate_upper_bound"] = r_up
        row[f"{kind}_false_quarantine_bound"] = exact_check.false_quarantine_bound(
            r_up, tokens, fraction
        )
    row.update(std=FLAGS.std, confidence=FLAGS.confidence)
    print(f"{'':>10} {'rate':>10} {'upper bound':>12} {'P(false quarantine)':>20}")
    for kind in ("mismatch", "flip"):
        print(f"{kind:>10} {row[f'honest_{kind}_rate']:>10.3g} "
              f"{row[f'{kind}_rate_upper_bound']:>12.3g} "
              f"{row[f'{kind}_false_quarantine_bound']:>20.3g}")  # fmt: skip
    print(
        f"{n} tokens ({FLAGS.dtype}, std {FLAGS.std}): max gap {row['max_gap']:.3g}, "
        f"max gap / max|z| {row['max_gap_over_scale']:.3g} (margin {row['margin']})"
    )
    with open(FLAGS.out, "w") as f:
        json.dump({"headline": {"honest_mismatch_rate": row["honest_mismatch_rate"]},
                   "rows": [row]}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    app.run(main)
