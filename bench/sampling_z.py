"""The sampling check's margin for honest engines (issue 23 item 6): the Z of a vLLM
engine's own samples against the fp32 learner on the same weights, in bf16 or fp32.

    python -m bench.sampling_z --out=/tmp/sampling_z_bf16.json --dtype=bfloat16 \
        [--std=0.2 --prompts=64 --n=8 --max_tokens=24]

An engine that computes in bf16 samples from q, a little off the learner's fp32 p: each of
its tokens adds E_q[log p] + H(p) = H(p) - H(q) - KL(q || p) to the check's sum in
expectation, a drift d per token where an exact sampler adds 0, so over N tokens Z grows like
(d / sqrt(v)) sqrt(N) (v: Var_p[log p] per token). The controller's sums decay
(audit.py: window W = `audit_window_tokens`, deviations by w, variances by w^2), so an
honest engine's Z levels off at about (d / sqrt(v)) sqrt(2 W), which must stay well inside
`audit_sampling_z` (6): below 6 / sqrt(2 W) = 0.066 per token at W = 4096.

Measured here, on a tiny Qwen3 model (weights N(0, std), `--std` 0.2: distributions far
from flat, as a trained policy's):
  * `z`, `z_decayed`: the engine's samples scored by transformers fp32 (the learner's
    numbers), at temperature 1, as the learner sums them (undecayed, and decayed as the
    controller does);
  * `drift_per_token`: the expected d / sqrt(v) from full distributions, q = transformers
    in `--dtype` on the same weights (vLLM's CPU bf16 kernels round differently, so this is
    the order, not vLLM's exact number), with `z_steady` = it x sqrt(2 W);
  * `k3_per_token`: the log-prob audit's mean k3 on the same tokens, for comparison;
  * `evidence_per_token`, `evidence_cusum_max`: the evidence test's (sampling_check.py)
    mean per token and the highest its CUSUM reached (one stat per completion; the
    controller quarantines at `audit_sampling_evidence`, 23).
One engine per process (vLLM engines are not torn down within a process).
"""

from __future__ import annotations

import json
import math
import os
import tempfile

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from bridge.contracts import sampling_check  # noqa: E402
from bridge.contracts.k3 import k3  # noqa: E402
from bridge.contracts.prompt import TextCodec  # noqa: E402
from bridge.model import tiny_model  # noqa: E402
from bridge.tasks import make_task  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_string("out", None, "JSON file for the results.", required=True)
flags.DEFINE_string("dtype", "bfloat16", "The engine's dtype (bfloat16 or float32).")
flags.DEFINE_float("std", 0.2, "Std of the tiny model's random weights.")
flags.DEFINE_integer("prompts", 64, "Prompts (arithmetic task).")
flags.DEFINE_integer("n", 8, "Samples per prompt.")
flags.DEFINE_integer("max_tokens", 24, "Tokens per sample at most.")
flags.DEFINE_integer("window", 4096, "The controller's audit_window_tokens.")


def model_dir(path: str) -> str:
    from safetensors.numpy import save_file

    cfg = tiny_model.tiny_config("qwen3")
    tiny_model.make_tiny_model(path, cfg)
    weights = tiny_model.random_hf_weights(cfg, seed=3, std=FLAGS.std)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def rows(model, torch, prompt, completion):
    """float64 log-softmax rows [len(completion), V] predicting each completion token."""
    ids = list(prompt) + list(completion)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, len(prompt) - 1 : len(ids) - 1]
    return torch.log_softmax(logits.double(), -1).numpy()


def decayed_z(devs, vars_, window: int) -> float:
    """Z as the controller keeps it (audit.py), one stat per completion."""
    dev = var = 0.0
    for (d, n), v in zip(devs, vars_, strict=True):
        keep = math.exp(-n / window)
        dev, var = keep * dev + d, keep * keep * var + v
    return sampling_check.z_score(dev, var)


def cusum_max(evidence) -> float:
    """The controller's evidence CUSUM (audit.py) over one stat per completion: its max."""
    c = worst = 0.0
    for e in evidence:
        c = max(0.0, c + e)
        worst = max(worst, c)
    return worst


def main(argv):
    del argv
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_gpu.engine import SampleRequest
    from rollout_gpu.vllm_engine import VllmEngine

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(tmp)
        codec = TextCodec(path)
        stream = make_task("arithmetic").train_prompts(0)
        prompts = [codec.encode_prompt(next(stream).text) for _ in range(FLAGS.prompts)]
        engine = VllmEngine.start(path, dtype=FLAGS.dtype, max_model_len=256, seed=0,
                                  max_num_seqs=16)  # fmt: skip
        reqs = [SampleRequest(prompt_token_ids=p, n=FLAGS.n, max_tokens=FLAGS.max_tokens,
                              temperature=1.0, seed=i) for i, p in enumerate(prompts)]  # fmt: skip
        samples = engine.generate(reqs)
        learner = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        engine_like = AutoModelForCausalLM.from_pretrained(
            path, dtype=getattr(torch, FLAGS.dtype)
        ).eval()
        devs, vars_, k3s, drift, var_all, evid = [], [], [], [], [], []
        for p, cs in zip(prompts, samples, strict=True):
            for c in cs:
                ids = list(c.token_ids)
                logp = rows(learner, torch, p, ids)
                h, v = sampling_check.position_moments(logp)
                s = logp[np.arange(len(ids)), ids]
                devs.append((float((s + h).sum()), len(ids)))
                vars_.append(float(v.sum()))
                evid.append(float((s - sampling_check.log_collision(logp)).sum()))
                k3s.append(float(k3(s - np.asarray(c.logprobs, np.float64)).sum()))
                q = np.exp(rows(engine_like, torch, p, ids))
                drift.append(float(((q * np.where(q > 0, logp, 0.0)).sum(-1) + h).sum()))
                var_all.append(float(v.sum()))
    tokens = sum(n for _, n in devs)
    per_token = sum(drift) / tokens / math.sqrt(sum(var_all) / tokens)
    result = {
        "dtype": FLAGS.dtype,
        "std": FLAGS.std,
        "tokens": tokens,
        "completions": len(devs),
        "z": sampling_check.z_score(sum(d for d, _ in devs), sum(vars_)),
        "z_decayed": decayed_z(devs, vars_, FLAGS.window),
        "k3_per_token": sum(k3s) / tokens,
        "evidence_per_token": sum(evid) / tokens,
        "evidence_cusum_max": cusum_max(evid),
        "var_per_token": sum(vars_) / tokens,
        "drift_per_token": per_token,
        "z_expected_undecayed": per_token * math.sqrt(tokens),
        "z_steady": per_token * math.sqrt(2 * FLAGS.window),
        "z_boundary_per_token": 6.0 / math.sqrt(2 * FLAGS.window),
        "window": FLAGS.window,
        "load_average": os.getloadavg(),
    }
    for k, v in result.items():
        print(f"{k:<24}{v:.4g}" if isinstance(v, float) else f"{k:<24}{v}")
    with open(FLAGS.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    app.run(main)
