"""A local vLLM worker for offline evaluation: prompt ids in, sampled completions out.

    python -m rollout_gpu.batch_generate --model_dir=HF_DIR --requests=IN.json --out=OUT.json

IN.json: {"requests": [{"prompt_token_ids": [...], "n": 8, "temperature": 0.6, "top_p": 0.95,
"top_k": -1, "min_p": 0.0, "max_tokens": 1024, "stop_token_ids": [...], "seed": 0}, ...]}
(the fields of `engine.SampleRequest`). OUT.json: {"completions": [[{"token_ids": [...],
"logprobs": [...], "finish_reason": "stop"}, ...] per request], "tokens": N,
"generate_s": S}.

`learner_jax.evaluation.evaluate`'s command line starts one of these per local worker on
its share of the prompts (learner_jax may not import vLLM, DESIGN.md's import rules), and scores the
results itself with the controller's trusted scorer: this process only samples.
"""

from __future__ import annotations

import json
import time

from absl import app, flags

from rollout_gpu.engine import SampleRequest

_FIELDS = set(SampleRequest.__dataclass_fields__)


def parse_requests(data: dict) -> list[SampleRequest]:
    """SampleRequests from IN.json's dict; ValueError naming an unknown field."""
    out = []
    for i, r in enumerate(data["requests"]):
        extra = set(r) - _FIELDS
        if extra:
            raise ValueError(f"request {i}: unknown fields {sorted(extra)}")
        out.append(SampleRequest(**r))
    return out


def run(model_dir: str, requests: list[SampleRequest], max_model_len: int, dtype: str, seed: int):
    from rollout_gpu.vllm_engine import VllmEngine

    engine = VllmEngine.start(model_dir, dtype=dtype, max_model_len=max_model_len, seed=seed)
    t0 = time.perf_counter()
    results = engine.generate(requests)
    took = time.perf_counter() - t0
    completions = [
        [
            {
                "token_ids": list(c.token_ids),
                "logprobs": c.logprobs,
                "finish_reason": c.finish_reason,
            }
            for c in samples
        ]
        for samples in results
    ]
    tokens = sum(len(c["token_ids"]) for samples in completions for c in samples)
    return {"completions": completions, "tokens": tokens, "generate_s": took}


def main(argv):
    del argv
    f = flags.FLAGS
    with open(f.requests) as fh:
        requests = parse_requests(json.load(fh))
    out = run(f.model_dir, requests, f.max_model_len, f.dtype, f.seed)
    with open(f.out, "w") as fh:
        json.dump(out, fh)


if __name__ == "__main__":
    flags.DEFINE_string("model_dir", None, "HF model directory.", required=True)
    flags.DEFINE_string("requests", None, "IN.json.", required=True)
    flags.DEFINE_string("out", None, "OUT.json.", required=True)
    flags.DEFINE_integer("max_model_len", 2048, "vLLM max_model_len (prompt + answer).")
    flags.DEFINE_string("dtype", "auto", "vLLM dtype (auto = the model's).")
    flags.DEFINE_integer("seed", 0, "Engine seed.")
    app.run(main)
