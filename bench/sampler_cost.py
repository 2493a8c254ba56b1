"""What the verifiable sampler costs generation: tokens/s with it against vLLM's own sampler.

    python -m bench.sampler_cost --out=/tmp/sampler_cost.json [--vocab=128,151936]

Per vocabulary size, a tiny Qwen3 (bridge/model/tiny_model.py; the tests' model at its own
vocabulary 128, the others with the vocabulary widened and random weights: the sampler's
work scales with V, the tiny model's own with V only through its 64-wide output head) is
served by one `VllmEngine`, and the same seeded batch (`--groups` x `--n` samples, T = 1,
`--max_tokens` each, EOS ignored so every arm makes the same tokens) is generated with
the verifiable sampler (rollout_gpu/verifiable_sampler.py) and with vLLM's own
`TopKTopPSampler`, swapped in and out of the one engine between arms (`collective_rpc`),
interleaved (the order alternates each round; a first untimed round warms both). Each
run is timed twice: wall clock (`wall_*`) and the process's CPU time (`cpu_*`: tokens per
CPU-second; the engine is in-process and synchronous, so on an idle machine the two
agree, while on a shared box wall time mostly measures the neighbours: measured 6x swings
between runs of one arm). The headline `sampler_tokens_per_s_ratio` (verifiable / vLLM's
own) is the median over rounds of each round's CPU-time ratio (`cpu_round_ratios`);
`wall_round_ratios` and the medians of both are recorded too. A real model spends far
more per token outside the sampler than this one, so a real run's ratio is closer to 1
than this one's. Each vocabulary runs in its own process: vLLM's in-process engines
cannot be torn down while another one lives. The load average is recorded.
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
    wall: dict[str, list[float]] = {arm: [] for arm in arms}
    cpu: dict[str, list[float]] = {arm: [] for arm in arms}
    for r in range(rounds + 1):
        for arm in list(arms)[:: 1 if r % 2 else -1]:
            engine.llm.collective_rpc(arms[arm])
            assert engine.llm.collective_rpc(verifiable_sampler.installed) == [arm == "verifiable"]
            t0, c0 = time.perf_counter(), time.process_time()
            outs = engine.llm.generate(prompts, params, use_tqdm=False)
            secs, cpu_secs = time.perf_counter() - t0, time.process_time() - c0
            tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
            assert tokens == groups * n * max_tokens, tokens
            if r:
                wall[arm].append(tokens / secs)
                cpu[arm].append(tokens / cpu_secs)
    engine.llm.collective_rpc(verifiable_sampler.install)
    (step_us,) = engine.llm.collective_rpc(_time_samplers, args=(groups * n,))

    def summary(rates: dict, kind: str) -> dict:
        ratios = [a / b for a, b in zip(rates["verifiable"], rates["vllm"], strict=True)]
        return {
            f"{kind}_tokens_per_s": rates,
            **{f"{kind}_{arm}_tokens_per_s": statistics.median(v) for arm, v in rates.items()},
            f"{kind}_round_ratios": ratios,
            f"{kind}_ratio": statistics.median(ratios),
        }

    return {
        "model_dir": model_dir,
        "vocab": int(engine.hf_config["vocab_size"]),
        "rows": groups * n,
        "tokens_per_run": groups * n * max_tokens,
        "engine_start_s": start_s,
        **summary(cpu, "cpu"),
        **summary(wall, "wall"),
        "sampler_tokens_per_s_ratio": summary(cpu, "cpu")["cpu_ratio"],
        "sampler_call_us": step_us,
        "loadavg": os.getloadavg(),
    }


def _time_samplers(worker, rows: int, reps: int = 30) -> dict:
    """Runs on the worker: median microseconds of one sampler call on [rows, V] logits
    (T = 1, no top-k/top-p, no request state: random keys), both samplers interleaved.
    Isolates what the end-to-end rates above measure through a noisy machine."""
    import torch

    mine = worker.model_runner.sampler.topk_topp_sampler
    samplers = {"verifiable": mine, "vllm": mine.original}
    vocab = worker.model_runner.model_config.get_vocab_size()
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {arm: [] for arm in samplers}
    for _ in range(reps):
        for arm, sampler in samplers.items():
            x = logits.clone()  # the samplers may work in place
            t0 = time.perf_counter()
            sampler(x, {}, None, None)
            times[arm].append((time.perf_counter() - t0) * 1e6)
    return {arm: statistics.median(v) for arm, v in times.items()}


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
                subprocess.run(cmd, check=True, cwd=ROOT)  # this checkout's bench
                rows += json.load(open(out))["rows"]
    print(f"{'vocab':>8} {'rows':>5}  tokens/CPU-s: verifiable, vllm, ratio;  wall ratio")
    for m in rows:
        mine, theirs = m["cpu_verifiable_tokens_per_s"], m["cpu_vllm_tokens_per_s"]
        ratio, wall = m["sampler_tokens_per_s_ratio"], m["wall_ratio"]
        print(
            f"{m['vocab']:>8} {m['rows']:>5}  {mine:10.1f} {theirs:10.1f} {ratio:6.3f}  {wall:6.3f}"
        )
        print(f"{'':>15}one sampler call, median us: {m['sampler_call_us']}")
    with open(FLAGS.out, "w") as f:
        widest = max(rows, key=lambda m: m["vocab"])  # the sampler's cost grows with V
        headline = {"sampler_tokens_per_s_ratio": widest["sampler_tokens_per_s_ratio"]}
        json.dump({"headline": headline, "rows": rows, "flags": kw}, f, indent=2)


if __name__ == "__main__":
    app.run(main)
