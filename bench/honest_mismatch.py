"""How often an HONEST worker's token fails the exact check: a real vLLM engine (bf16 by
default) samples with the seeded sampler (rollout_gpu/verifiable_sampler.py), the fp32
learner's checker (learner_jax/rl/exact_check.py) recomputes every token from the same HF
weights, and the gaps are counted against a range of margins.

    python -m bench.honest_mismatch --out=/tmp/honest.json [--dtype=bfloat16 --groups=64]

Also derives the quarantine threshold from the measured rate: with m mismatches in n honest
tokens, r_up is the one-sided 1 - `--confidence` Clopper-Pearson upper bound of the rate,
and K the smallest count with P(Poisson(r_up x `--run_tokens`) >= K) <= `--false_alarm`: an
honest worker that samples `run_tokens` tokens in a run is quarantined with probability at
most `false_alarm` (at the true rate <= r_up).

The model: the tiny Qwen3 architecture with weights of std `--std` (0.02: nearly flat
distributions over 128 tokens, the worst case for near-ties; 0.2: peaked, like a trained
model's). bench/verify_cost.py reports its headline `honest_mismatch_rate` from here.
"""

from __future__ import annotations

import json
import os
import tempfile

import numpy as np
from absl import app, flags
from scipy import stats as scipy_stats

MARGINS = (0.0, 1e-4, 1e-3, 1e-2, 0.03, 0.1, 0.3)


def quarantine_threshold(mismatches: int, tokens: int, run_tokens: float, false_alarm: float,
                         confidence: float = 1e-3) -> tuple[float, int]:  # fmt: skip
    """(r_up, K): the rate's upper bound and the smallest count an honest worker reaches
    over `run_tokens` with probability <= `false_alarm`."""
    r_up = float(scipy_stats.beta.ppf(1 - confidence, mismatches + 1, max(tokens - mismatches, 1)))
    lam = r_up * run_tokens
    k = 1
    while scipy_stats.poisson.sf(k - 1, lam) > false_alarm:  # P(X >= k)
        k += 1
    return r_up, k


def measure(model_dir: str, dtype: str = "bfloat16", groups: int = 32, n: int = 4,
            max_tokens: int = 32, temperature: float = 1.0, margin: float | None = None,
            engine=None) -> dict:  # fmt: skip
    """Gaps of honest tokens: `groups` seeded requests of `n` samples each."""
    from bridge.contracts import exact_check, gumbel
    from bridge.control.protocol import ConsumedGroup, Trajectory
    from learner_jax import hf_import
    from learner_jax.rl.exact_check import ExactChecker
    from rollout_gpu.engine import SampleRequest
    from rollout_gpu.vllm_engine import VllmEngine

    margin = exact_check.MARGIN if margin is None else margin
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
    checker = ExactChecker(lambda v: params, cfg, temperature=temperature, margin=float("inf"))
    gaps = checker.gaps_of(batch)
    row = {
        "dtype": dtype,
        "tokens": int(gaps.size),
        "max_gap": float(gaps.max()) if gaps.size else 0.0,
        "gap_quantiles": {q: float(np.quantile(gaps, q)) for q in (0.5, 0.99, 0.999)},
        "mismatch_rate": {str(m): float((gaps > m).mean()) for m in MARGINS},
        "margin": margin,
        "mismatches": int((gaps > margin).sum()),
        "honest_mismatch_rate": float((gaps > margin).mean()),
    }
    return row


FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "JSON file for the results.", required=True)
flags.DEFINE_string("dtype", "bfloat16", "The engine's dtype (the learner checks in fp32).")
flags.DEFINE_integer("groups", 64, "Seeded requests.")
flags.DEFINE_integer("n", 4, "Samples per request.")
flags.DEFINE_integer("max_tokens", 32, "Tokens per sample.")
flags.DEFINE_float("std", 0.02, "Std of the tiny model's random weights.")
flags.DEFINE_float("run_tokens", 1e6, "An honest worker's tokens in one run (for K).")
flags.DEFINE_float("false_alarm", 1e-6, "Allowed probability of quarantining it.")


def main(argv):
    del argv
    from safetensors.numpy import save_file

    from bridge.model import tiny_model
    from rollout_gpu.vllm_engine import configure_cpu_process

    configure_cpu_process(1.0)
    with tempfile.TemporaryDirectory() as d:
        cfg = tiny_model.tiny_config("qwen3")
        tiny_model.make_tiny_model(d, cfg)
        weights = tiny_model.random_hf_weights(cfg, seed=3, std=FLAGS.std)
        save_file(weights, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        row = measure(d, FLAGS.dtype, FLAGS.groups, FLAGS.n, FLAGS.max_tokens)
    r_up, k = quarantine_threshold(row["mismatches"], row["tokens"], FLAGS.run_tokens,
                                   FLAGS.false_alarm)  # fmt: skip
    row.update(std=FLAGS.std, rate_upper_bound=r_up, quarantine_tokens=k,
               run_tokens=FLAGS.run_tokens, false_alarm=FLAGS.false_alarm)  # fmt: skip
    print(f"{'margin':>8} {'mismatch rate':>14}")
    for m, r in row["mismatch_rate"].items():
        print(f"{m:>8} {r:>14.3g}")
    print(f"{row['tokens']} tokens, max honest gap {row['max_gap']:.3g}; at margin "
          f"{row['margin']}: {row['mismatches']} mismatches, r <= {r_up:.3g}, K = {k}")  # fmt: skip
    with open(FLAGS.out, "w") as f:
        json.dump({"headline": {"honest_mismatch_rate": row["honest_mismatch_rate"]},
                   "rows": [row]}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    app.run(main)
