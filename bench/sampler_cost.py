"""What the verifiable sampler costs generation: tokens/s with it against vLLM's own sampler.

    python -m bench.sampler_cost --out=/tmp/sampler_cost.json [--vocab=128,151936]

Per vocabulary size, a tiny Qwen3 (bridge/model/tiny_model.py; the tests' model at its own
vocabulary 128, the others with the vocabulary widened and random weights: the sampler's
work scales with V, the tiny model's own with V only through its 64-wide output head) is
served by one `VllmEngine`, and the same seeded batch (`--groups` x `--n` samples, T = 1,
`--max_tokens` each, EOS ignored so every arm makes the same tokens) is generated with
the verifiable sampler (rollout_gpu/verifiable_sampler.py) and with vLLM's own
`TopKTopPSampler`, swapped in and out of the one engine between arms (`collective_rpc`),
interleaved (the order alternates each round; a first untimed round warms both). The
headline `sampler_tokens_per_s_ratio` (verifiable / vLLM's own) is the median over rounds
of each round's ratio (the two arms of a round run back to back, so a shared box's load,
which drifts over seconds, mostly cancels); `median_tokens_per_s_ratio` is the ratio of
the arms' median tokens/s. A real model spends far more per token outside the sampler
than this one, so a real run's ratio is closer to 1 than this one's. Each vocabulary runs
in its own process: vLLM's in-process engines cannot be torn down while another one
lives. CPU timings on a shared box are noisy: the load average is recorded.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "JSON file for the results.", required=True)
flags.DEFINE_list("vocab", ["128", "151936"], "Vocabulary sizes (128: the tests' model).")
flags.DEFINE_string("model_dir", None, "Measure this model dir only (in this process).")
flags.DEFINE_integer("groups", 8, "Prompts per batch.")
flags.DEFINE_integer("n", 8, "Samples per prompt.")
flags.DEFINE_integer("max_tokens", 64, "Tokens per sample.")
flags.DEFINE_integer("rounds", 5, "Timed rounds (each: both arms) after one warm-up round.")


def measure(
    model_dir: str, groups: int = 8, n: int = 8, max_tokens: int = 64, rounds: int = 5
) -> dict:
    """Median generation tokens/s of both samplers on one engine, interleaved."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import numpy as np
    from vllm import SamplingParams

    from rollout_gpu import verifiable_sampler
    from rollout_gpu.vllm_engine import VllmEngine

    t0 = time.perf_counter()
    engine = VllmEngine.start(model_dir, dtype="float32", max_model_len=512, seed=0,
                              max_num_seqs=groups * n)  # fmt: skip
    start_s = time.perf_counter() - t0
    assert engine.verifiable
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": [1] + rng.integers(3, 90, 15).tolist()} for _ in range(groups)]
    params = [
        SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=1000 * g,
                       ignore_eos=True, logprobs=0)
        for g in range(groups)
    ]  # fmt: skip
    arms = {"verifiable": verifiable_sampler.install, "vllm": verifiable_sampler.uninstall}
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    for r in range(rounds + 1):
        for arm in list(arms)[:: 1 if r % 2 else -1]:
            engine.llm.collective_rpc(arms[arm])
            assert engine.llm.collective_rpc(verifiable_sampler.installed) == [arm == "verifiable"]
            t0 = time.perf_counter()
            outs = engine.llm.generate(prompts, params, use_tqdm=False)
            secs = time.perf_counter() - t0
            tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
            assert tokens == groups * n * max_tokens, tokens
            if r:
                rates[arm].append(tokens / secs)
    engine.llm.collective_rpc(verifiable_sampler.install)
    med = {arm: statistics.median(v) for arm, v in rates.items()}
    ratios = [a / b for a, b in zip(rates["verifiable"], rates["vllm"], strict=True)]
    return {
        "model_dir": model_dir,
        "vocab": int(engine.hf_config["vocab_size"]),
        "rows": groups * n,
        "tokens_per_run": groups * n * max_tokens,
        "engine_start_s": start_s,
        "tokens_per_s": rates,
        "verifiable_tokens_per_s": med["verifiable"],
        "vllm_tokens_per_s": med["vllm"],
        "round_ratios": ratios,
        "sampler_tokens_per_s_ratio": statistics.median(ratios),
        "median_tokens_per_s_ratio": med["verifiable"] / med["vllm"],
        "loadavg": os.getloadavg(),
    }


def _model_dir(root: str, vocab: int) -> str:
    from bridge.model import tiny_model

    cfg = tiny_model.tiny_config("qwen3")
    if vocab != cfg.vocab_size:
        cfg = tiny_model.tiny_config("qwen3", vocab_size=vocab)
    return tiny_model.make_tiny_model(os.path.join(root, f"qwen3_v{vocab}"), cfg, seed=0)


def main(argv):
    del argv
    kw = dict(groups=FLAGS.groups, n=FLAGS.n, max_tokens=FLAGS.max_tokens, rounds=FLAGS.rounds)
    if FLAGS.model_dir:
        rows = [measure(FLAGS.model_dir, **kw)]
    else:
        rows = []
        with tempfile.TemporaryDirectory() as root:
            for vocab in map(int, FLAGS.vocab):
                out = os.path.join(root, f"v{vocab}.json")
                cmd = [sys.executable, "-m", "bench.sampler_cost", f"--out={out}",
                       f"--model_dir={_model_dir(root, vocab)}",
                       *[f"--{k}={v}" for k, v in kw.items()]]  # fmt: skip
                subprocess.run(cmd, check=True)
                rows += json.load(open(out))["rows"]
    print(f"{'vocab':>8} {'rows':>5} {'verifiable tok/s':>17} {'vllm tok/s':>11} {'ratio':>6}")
    for m in rows:
        rates = (m["verifiable_tokens_per_s"], m["vllm_tokens_per_s"])
        ratio = m["sampler_tokens_per_s_ratio"]
        print(f"{m['vocab']:>8} {m['rows']:>5} {rates[0]:>17.1f} {rates[1]:>11.1f} {ratio:>6.3f}")
    with open(FLAGS.out, "w") as f:
        json.dump({"rows": rows, "flags": kw}, f, indent=2)


if __name__ == "__main__":
    app.run(main)
