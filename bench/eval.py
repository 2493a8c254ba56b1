"""Evaluation throughput: the learner's decoder with a KV cache vs without, and the fleet.

    python -m bench.eval --out=/tmp/eval_bench.json [--prompts=8] [--answer_len=576] \
        [--no_fleet] [--quick]

Same prompts (the arithmetic task's first held-out prompts, left-padded to 16 tokens),
greedy (temperature 0), `--answer_len` new tokens each, on the demo's tiny model shape
(configs/tiny_arith.py: Qwen3, 4 layers x 128) with random weights whose stop tokens can
never win (`tiny_model.make_tiny_model(never_stop=True)`), so every answer runs to full
length and the three arms decode the same number of tokens:

- learner, KV cache: `evaluate.Evaluator` (learner_jax/model/kv_decode.py: prefill, then one
  token per step), the learner's own evaluator (`eval.on=learner`, or no workers);
- learner, no cache: `EvalConfig(kv_cache=False)`, the cache-free reference (the full
  [B, P + A] forward at every step: work grows as A^2);
- fleet: one local vLLM worker (`rollout_gpu.batch_generate`, what
  `python -m learner_jax.evaluate` starts) on the same HF directory, fp32.

The KV-cache arm runs twice; the second (compiled) run is timed, the first's extra time
is reported as compile. The cache-free arm runs once (minutes at 576 tokens): its time
includes its compile, which is seconds (the same order as the cached arm's). The fleet's
tokens/s counts generation only; its engine start is in `start_s`. Answers:
`same_as_cached` is the number of prompts whose whole answer is token-for-token the
KV-cache arm's, `common_prefix` the mean length of the shared prefix.
Prints a table and writes JSON, `{"headline": {...}, "rows": [one per arm], ...}`:

- `kv_speedup`: tokens/s of the KV-cache arm / the cache-free arm (ours / baseline);
- `same_answers`: every arm's answers equal the KV-cache arm's, token for token;
- `fleet_vs_learner_tokens_per_s`: the fleet arm's tokens/s / the KV-cache arm's (None
  without the fleet arm, `--no_fleet`).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

PROMPT_LEN = 16


def model_dir(root: str, answer_len: int) -> str:
    from bridge.model import tiny_model

    cfg = tiny_model.tiny_config(
        "qwen3", num_layers=4, hidden_size=128, intermediate_size=256,
        tie_word_embeddings=False, max_position_embeddings=max(512, PROMPT_LEN + answer_len),
    )  # fmt: skip
    return tiny_model.make_tiny_model(os.path.join(root, "model"), cfg, seed=0, never_stop=True)


def learner_arm(path: str, task, answer_len: int, kv_cache: bool, twice: bool = True) -> dict:
    import jax

    from bridge.contracts.prompt import TextCodec
    from learner_jax.evaluation import evaluate
    from learner_jax.model import hf_import, sharding

    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    cfg, params = hf_import.load_hf_params(path, mesh)
    ev = evaluate.Evaluator(
        cfg, TextCodec(path), task, evaluate.EvalConfig(PROMPT_LEN, answer_len, kv_cache=kv_cache)
    )
    t0 = time.perf_counter()
    ids = ev.completion_ids(params, mesh)
    first = time.perf_counter() - t0
    if not twice:
        return {"ids": ids, "seconds": first}
    t0 = time.perf_counter()
    ids = ev.completion_ids(params, mesh)
    took = time.perf_counter() - t0
    return {"ids": ids, "seconds": took, "compile_s": max(0.0, first - took)}


def fleet_arm(path: str, task, answer_len: int, scratch: str) -> dict:
    from bridge.contracts.prompt import TextCodec
    from learner_jax.evaluation import eval_cli

    codec = TextCodec(path)
    requests = [
        {
            "prompt_token_ids": codec.encode_prompt(p.text), "n": 1, "temperature": 0.0,
            "max_tokens": answer_len, "stop_token_ids": [codec.eos_id], "seed": 0,
        }
        for p in task.eval_prompts()
    ]  # fmt: skip
    out = eval_cli.generate_local(path, requests, 1, scratch, dtype="float32")
    ids = []
    for samples in out["completions"]:
        row = list(samples[0]["token_ids"])
        ids.append(row[: row.index(codec.eos_id)] if codec.eos_id in row else row)
    return {
        "ids": ids,
        "seconds": out["generate_s"],
        "start_s": out["wall_s"] - out["generate_s"],
    }


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def run(prompts: int, answer_len: int, fleet: bool, root: str) -> dict:
    from bridge import tasks

    path = model_dir(root, answer_len)
    task = tasks.make_task("arithmetic", eval_size=prompts)
    arms = {"learner_kv_cache": learner_arm(path, task, answer_len, True)}
    arms["learner_no_cache"] = learner_arm(path, task, answer_len, False, twice=False)
    if fleet:
        arms["fleet_vllm"] = fleet_arm(path, task, answer_len, root)
    ref = arms["learner_kv_cache"]["ids"]
    rows = []
    for name, arm in arms.items():
        tokens = sum(map(len, arm["ids"]))
        rows.append(
            {
                "arm": name,
                "tokens": tokens,
                "seconds": arm["seconds"],
                "tokens_per_s": tokens / arm["seconds"],
                "same_as_cached": sum(a == b for a, b in zip(arm["ids"], ref, strict=True)),
                "common_prefix": sum(map(_prefix, arm["ids"], ref)) / len(ref),
                **{k: arm[k] for k in ("compile_s", "start_s") if k in arm},
            }
        )
    return {
        "headline": headline(rows, prompts), "rows": rows,
        "prompts": prompts, "answer_len": answer_len, "prompt_len": PROMPT_LEN,
        "model": "tiny qwen3 4x128, untied never-stop head, fp32",
        "answers": {name: arm["ids"] for name, arm in arms.items()},
    }  # fmt: skip


def headline(rows: list[dict], prompts: int) -> dict:
    """The bench's three numbers (module docstring) from its per-arm rows."""
    by = {r["arm"]: r for r in rows}
    cached = by["learner_kv_cache"]["tokens_per_s"]
    fleet = by.get("fleet_vllm")
    return {
        "kv_speedup": cached / by["learner_no_cache"]["tokens_per_s"],
        "same_answers": all(r["same_as_cached"] == prompts for r in rows),
        "fleet_vs_learner_tokens_per_s": None if fleet is None else fleet["tokens_per_s"] / cached,
    }


def table(result: dict) -> str:
    head = f"{'arm':<18}{'tokens':>8}{'seconds':>10}{'tokens/s':>11}{'same':>6}{'prefix':>8}"
    lines = [head]
    for r in result["rows"]:
        lines.append(
            f"{r['arm']:<18}{r['tokens']:>8}{r['seconds']:>10.2f}{r['tokens_per_s']:>11.1f}"
            f"{r['same_as_cached']:>4}/{result['prompts']}{r['common_prefix']:>8.1f}"
        )
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--answer_len", type=int, default=576)
    p.add_argument("--no_fleet", action="store_true", help="learner arms only (no vLLM)")
    p.add_argument("--quick", action="store_true", help="4 prompts, 128-token answers")
    p.add_argument("--workdir", default="", help="model dir + scratch (default: a temp dir)")
    a = p.parse_args(argv)
    if a.quick:
        a.prompts, a.answer_len = 4, 128
    if a.prompts < 1 or a.answer_len < 1:
        p.error("--prompts and --answer_len must be >= 1")
    with tempfile.TemporaryDirectory(prefix="bench_eval_") as tmp:
        result = run(a.prompts, a.answer_len, not a.no_fleet, a.workdir or tmp)
    print(f"{a.prompts} prompts x {a.answer_len} greedy tokens, {result['model']}")
    print(table(result))
    print("headline: " + json.dumps(result["headline"]))
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
