"""MoE routing between a vLLM engine and the learner: the honest disagreement rate, and
what routing replay does to train/inference mismatch on the tiny end-to-end run.

    python -m bench.moe_routing --out=/tmp/moe_routing.json [--workdir=DIR]

Two measurements, one JSON (`{"headline": {...}, "rows": [...]}`):
- `honest_routing_disagreement_bf16` (and `_fp32`): a vLLM engine of that dtype samples
  from the tiny Qwen3-MoE; its recorded experts (rollout_gpu/routing_capture.py) are
  compared with float32 routing of the same weights over the same token sequences
  (transformers' router, which the learner's equals up to float32 rounding): the fraction
  of expert slots that differ, and of (token, layer) rows with another expert set. The
  audit's threshold sits above the bf16 rate (bridge/contracts/routing.py).
- `replay_kl_ratio`: configs/qwen3_moe_shaped.py's run (bf16 engine, fp32 learner, replay
  on) reports, every step and on the same tokens, the mismatch KL with the engine's routing
  replayed and with the learner's own (`mismatch/kl_replay`, `mismatch/kl_no_replay`); the
  ratio of their token-weighted means over the run. `--workdir` reads an existing run's
  metrics.jsonl instead of running it (`replay_kl_ratio(workdir)` is what bench/moe.py
  calls).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from bridge.model import tiny_model

CONFIG = "configs/qwen3_moe_shaped.py"


def replay_kl_ratio(workdir: str) -> dict:
    """From a run's metrics.jsonl: the token-weighted mean mismatch KL with and without
    replay over its RL steps, their ratio, and the per-layer routing agreement."""
    lines = []
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            if "mismatch/kl_replay" in m and m.get("mismatch/tokens", 0) > 0:
                lines.append(m)
    if not lines:
        raise ValueError(f"{workdir}/metrics.jsonl has no step with mismatch/kl_replay")
    n = np.array([m["mismatch/tokens"] for m in lines], np.float64)
    kl_r = float(np.dot(n, [m["mismatch/kl_replay"] for m in lines]) / n.sum())
    kl_o = float(np.dot(n, [m["mismatch/kl_no_replay"] for m in lines]) / n.sum())
    layers = sorted({k for m in lines for k in m if k.startswith("moe/routing_agreement/")})
    return {
        "steps": len(lines),
        "tokens": float(n.sum()),
        "kl_replay": kl_r,
        "kl_no_replay": kl_o,
        "replay_kl_ratio": kl_r / kl_o if kl_o > 0 else float("nan"),
        "routing_agreement": float(np.mean([m["moe/routing_agreement"] for m in lines])),
        **{k: float(np.mean([m[k] for m in lines if k in m])) for k in layers},
    }


def run_e2e(workdir: str, steps: int | None = None) -> None:
    cmd = [sys.executable, "-m", "learner_jax.train", f"--config={CONFIG}", f"--workdir={workdir}"]
    if steps is not None:
        cmd.append(f"--config.total_steps={steps}")
    subprocess.run(cmd, check=True)


def honest_routing(dtype: str, samples: int = 64, seed: int = 0) -> dict:
    """A `dtype` vLLM engine's recorded routing against float32 routing of the same tiny
    Qwen3-MoE over the same sequences (samples of 13 prompt + up to 32 tokens, T = 1)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_gpu.engine import SampleRequest
    from rollout_gpu.vllm_engine import VllmEngine

    cfg = tiny_model.tiny_config("qwen3_moe")
    path = tiny_model.make_tiny_model(tempfile.mkdtemp(prefix="moe_routing_"), cfg, seed=seed)
    engine = VllmEngine.start(path, dtype=dtype, max_model_len=256, seed=seed)
    rng = np.random.default_rng(seed)
    requests = [
        SampleRequest([tiny_model.BOS_ID] + rng.integers(3, 90, 12).tolist(), n=4,
                      temperature=1.0, max_tokens=32, seed=100 + i)
        for i in range(samples // 4)
    ]  # fmt: skip
    outs = engine.generate(requests)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    k, rows, slots_off, rows_off = cfg.num_experts_per_tok, 0, 0.0, 0
    for r, samples_ in zip(requests, outs, strict=True):
        for s in samples_:
            seq = list(r.prompt_token_ids) + list(s.token_ids)
            with torch.no_grad():
                out = model(torch.tensor([seq[:-1]]), output_router_logits=True)
            for j, logits in enumerate(out.router_logits):
                own = torch.topk(logits.float(), k, -1).indices.numpy()
                rec = s.routed_experts[:, j]
                overlap = np.array(
                    [len(set(a) & set(b)) / k for a, b in zip(own, rec, strict=True)]
                )
                rows += len(overlap)
                slots_off += float((1 - overlap).sum())
                rows_off += int((overlap < 1).sum())
    return {
        "dtype": dtype,
        "rows": rows,
        "slot_disagreement": slots_off / rows,
        "row_disagreement": rows_off / rows,
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--workdir", default="", help="an existing qwen3_moe_shaped run to read")
    p.add_argument("--skip_honest", action="store_true", help="only the e2e ratio")
    a = p.parse_args()
    rows = []
    headline = {}
    if not a.skip_honest:
        for dtype in ("bfloat16", "float32"):
            # One engine per process: vLLM's in-process engines do not tear down cleanly.
            code = (
                "import json, sys; from bench.moe_routing import honest_routing; "
                f"print(json.dumps(honest_routing({dtype!r})))"
            )
            out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                 text=True).stdout  # fmt: skip
            row = json.loads(out.strip().splitlines()[-1])
            rows.append({"measure": "honest_routing", **row})
            short = "bf16" if dtype == "bfloat16" else "fp32"
            headline[f"honest_routing_disagreement_{short}"] = row["slot_disagreement"]
    workdir = a.workdir or tempfile.mkdtemp(prefix="echo2_moe_")
    if not a.workdir:
        run_e2e(workdir)
    e2e = replay_kl_ratio(workdir)
    rows.append({"measure": "e2e", "workdir": workdir, **e2e})
    headline["replay_kl_ratio"] = e2e["replay_kl_ratio"]
    for r in rows:
        print(r)
    with open(a.out, "w") as f:
        json.dump({"headline": headline, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
