"""Evaluate a checkpoint or an HF directory on a benchmark file through local vLLM workers.

    python -m learner_jax.evaluate --checkpoint_dir=DIR|--hf_dir=DIR --eval_file=F \
        --n=8 --k=1,8 [--temperature=0.6 --top_p=0.95 --max_tokens=4096 --thinking=on] \
        [--workers=2] [--out=F.json]

A learner checkpoint is exported to an HF directory first (bridge/export.py). The file is
read as `task.eval_file` reads it (bridge/tasks/eval_file.py: GSM8K, MATH-500, AIME
layouts). Prompts are encoded by the controller's codec (bridge/contracts/prompt.py, the
chat template when the tokenizer has one, with `enable_thinking` from --thinking), split
over `--workers` local vLLM processes (rollout_gpu/batch_generate.py; learner_jax does not
import vLLM), and every completion is scored by the controller's trusted scorer
(`RewardScorer`: hidden tokens score 0, only the text after the last `</think>` counts,
math-verify in the reward pool under a timeout). The table: pass@1 and pass@k (unbiased,
bridge/contracts/pass_at_k.py) overall and per subject where the file has subjects, mean
completion length and thinking length; `--out` writes it as JSON (and markdown beside it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from bridge.contracts import pass_at_k
from bridge.contracts.prompt import PromptFormat, TextCodec
from bridge.contracts.thinking import prompt_thinking
from bridge.control.intake.rewards import RewardScorer
from bridge.control.protocol import WorkerTrajectory
from bridge.tasks.eval_file import DEFAULT_INSTRUCTION, EvalFileTask


@dataclasses.dataclass(frozen=True)
class Sampling:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 1024
    seed: int = 0


def resolve_model_dir(checkpoint_dir: str, hf_dir: str, scratch: str) -> str:
    """The HF directory to serve: `hf_dir`, or the latest checkpoint exported under `scratch`."""
    if bool(checkpoint_dir) == bool(hf_dir):
        raise ValueError("pass exactly one of --checkpoint_dir and --hf_dir")
    if hf_dir:
        return hf_dir
    from bridge.export import ExportOptions, export

    out = os.path.join(scratch, "model")
    export(ExportOptions(checkpoint_dir=checkpoint_dir, output_dir=out))
    return out


def make_codec(model_dir: str, thinking: str, fmt: str = "") -> TextCodec:
    """The chat template when the tokenizer has one (else plain), `enable_thinking` set."""
    probe = TextCodec(model_dir)
    kind = fmt or ("chat" if probe.chat_template else "plain")
    mode = prompt_thinking(thinking)
    return TextCodec(model_dir, PromptFormat(kind, thinking=mode if kind == "chat" else ""))


def requests_for(prompt_ids: list[list[int]], s: Sampling, stop_ids: list[int]) -> list[dict]:
    return [
        dict(
            prompt_token_ids=ids, n=s.n, temperature=s.temperature, top_p=s.top_p,
            top_k=s.top_k, min_p=s.min_p, max_tokens=s.max_tokens, stop_token_ids=stop_ids,
            seed=s.seed + i,
        )
        for i, ids in enumerate(prompt_ids)
    ]  # fmt: skip


def generate_local(
    model_dir: str, requests: list[dict], workers: int, scratch: str, dtype: str = "auto"
) -> dict:
    """Completions per request from `workers` local vLLM processes, each on every
    `workers`-th request, in vLLM's `dtype` (its "auto" runs an fp32 checkpoint in 16
    bits); {"completions", "tokens", "generate_s", "wall_s"}."""
    workers = max(1, min(workers, len(requests)))
    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in requests)
    procs, t0 = [], time.perf_counter()
    for w in range(workers):
        src, dst = (os.path.join(scratch, f"{kind}_{w}.json") for kind in ("in", "out"))
        with open(src, "w") as f:
            json.dump({"requests": requests[w::workers]}, f)
        cmd = [sys.executable, "-m", "rollout_gpu.batch_generate", f"--model_dir={model_dir}",
               f"--requests={src}", f"--out={dst}", f"--max_model_len={longest}",
               f"--dtype={dtype}"]  # fmt: skip
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        procs.append((subprocess.Popen(cmd, env=env), dst))
    completions: list = [None] * len(requests)
    tokens, generate_s = 0, 0.0
    for w, (proc, dst) in enumerate(procs):
        if proc.wait() != 0:
            raise RuntimeError(f"local vLLM worker {w} failed (exit {proc.returncode})")
        with open(dst) as f:
            out = json.load(f)
        completions[w::workers] = out["completions"]
        tokens += out["tokens"]
        generate_s = max(generate_s, out["generate_s"])  # the workers run side by side
    wall_s = time.perf_counter() - t0  # engine starts included
    return {
        "completions": completions,
        "tokens": tokens,
        "generate_s": generate_s,
        "wall_s": wall_s,
    }


def score(task, codec, prompts, requests, completions, timeout_s: float = 5.0) -> list[dict]:
    """Per prompt: rewards, completion lengths, thinking tokens (the trusted scorer's)."""
    scorer = RewardScorer(task, codec, timeout_s=timeout_s)
    out = []
    for g, (prompt, req, samples) in enumerate(zip(prompts, requests, completions, strict=True)):
        trajs = [
            WorkerTrajectory(
                prompt_id=prompt.prompt_id, sample_index=i,
                prompt_token_ids=req["prompt_token_ids"], completion_token_ids=c["token_ids"],
                logprobs=c["logprobs"], versions=[0] * len(c["token_ids"]),
                finish_reason=c["finish_reason"],
            )
            for i, c in enumerate(samples)
        ]  # fmt: skip
        scored, _ = scorer.score_group(g, prompt, trajs)
        out.append(
            {
                "prompt_id": prompt.prompt_id,
                "rewards": [t.reward for t in scored],
                "lengths": [len(t.completion_token_ids) for t in scored],
                "think": [t.think_tokens for t in scored],
            }
        )
    return out


def summarize(per_prompt: list[dict], ks: list[int], subjects: dict[str, str]) -> list[dict]:
    """Table rows: 'all', then one per subject (where the file has subjects)."""
    groups = {"all": per_prompt}
    for p in per_prompt:
        if subjects.get(p["prompt_id"]):
            groups.setdefault(subjects[p["prompt_id"]], []).append(p)
    rows = []
    for name, ps in groups.items():
        counts = [(len(p["rewards"]), sum(r >= 1.0 for r in p["rewards"])) for p in ps]
        row = {"subset": name, "prompts": len(ps)}
        row["accuracy"] = float(np.mean([c / n for n, c in counts]))
        for k in ks:
            row[f"pass@{k}"] = pass_at_k.mean_pass_at_k(counts, k)
        row["mean_length"] = float(np.mean([x for p in ps for x in p["lengths"]]))
        row["think_length"] = float(np.mean([x for p in ps for x in p["think"]]))
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = [f"{v:.4f}" if isinstance(v, float) else str(v) for v in r.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def evaluate_file(
    model_dir: str, eval_file: str, s: Sampling, ks: list[int], workers: int = 1,
    thinking: str = "auto", fmt: str = "", scratch: str | None = None,
    instruction: str = DEFAULT_INSTRUCTION,
) -> dict:  # fmt: skip
    """The whole evaluation; {"rows": table rows, "prompts": per-prompt results, ...}."""
    ks = pass_at_k.parse_ks(ks, s.n)
    if s.temperature == 0.0 and s.n > 1:  # vLLM refuses it too
        raise ValueError("--temperature=0 (greedy) gives n identical samples: use --n=1")
    task = EvalFileTask(eval_file, instruction)
    codec = make_codec(model_dir, thinking, fmt)
    prompts = task.eval_prompts()
    requests = requests_for([codec.encode_prompt(p.text) for p in prompts], s, [codec.eos_id])
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        gen = generate_local(model_dir, requests, workers, tmp)
    per_prompt = score(task, codec, prompts, requests, gen["completions"])
    rows = summarize(per_prompt, ks, task.subjects())
    return {
        "rows": rows,
        "prompts": per_prompt,
        "completions": gen["completions"],
        "sampling": dataclasses.asdict(s),
        "tokens_per_s": gen["tokens"] / gen["generate_s"],  # sampling only
        "wall_s": gen["wall_s"],  # engine starts included
        "model_dir": model_dir,
        "eval_file": eval_file,
    }


def main(argv):
    del argv
    from absl import flags

    f = flags.FLAGS
    s = Sampling(f.n, f.temperature, f.top_p, f.top_k, f.min_p, f.max_tokens, f.seed)
    with tempfile.TemporaryDirectory() as scratch:
        model_dir = resolve_model_dir(f.checkpoint_dir, f.hf_dir, scratch)
        result = evaluate_file(
            model_dir, f.eval_file, s, pass_at_k.parse_ks(f.k, f.n), f.workers, f.thinking,
            f.prompt_format, instruction=f.instruction,
        )  # fmt: skip
    table = markdown(result["rows"])
    print(table)
    if f.out:
        with open(f.out, "w") as fh:
            json.dump({k: v for k, v in result.items() if k != "completions"}, fh, indent=1)
        with open(os.path.splitext(f.out)[0] + ".md", "w") as fh:
            fh.write(table + "\n")


def define_flags():
    from absl import flags

    flags.DEFINE_string("checkpoint_dir", "", "Learner checkpoint dir (latest step exported).")
    flags.DEFINE_string("hf_dir", "", "Or an HF model directory.")
    flags.DEFINE_string("eval_file", None, "Benchmark JSONL/Parquet.", required=True)
    flags.DEFINE_integer("n", 1, "Samples per prompt.")
    flags.DEFINE_string("k", "1", "pass@k for these k (comma-separated, each <= n).")
    flags.DEFINE_float("temperature", 1.0, "Sampling temperature (0 = greedy).")
    flags.DEFINE_float("top_p", 1.0, "Top-p.")
    flags.DEFINE_integer("top_k", -1, "Top-k (-1 = off).")
    flags.DEFINE_float("min_p", 0.0, "Min-p.")
    flags.DEFINE_integer("max_tokens", 1024, "Completion tokens at most.")
    flags.DEFINE_integer("seed", 0, "Sampling seed (prompt i uses seed + i).")
    flags.DEFINE_integer("workers", 1, "Local vLLM worker processes.")
    flags.DEFINE_enum("thinking", "auto", ["auto", "on", "off"], "enable_thinking.")
    flags.DEFINE_enum("prompt_format", "", ["", "plain", "chat"], "'' = chat if it has one.")
    flags.DEFINE_string("instruction", DEFAULT_INSTRUCTION, "Appended to each question.")
    flags.DEFINE_string("out", "", "Write the table as JSON here (and .md beside it).")


def run_main():
    from absl import app

    define_flags()
    app.run(main)
