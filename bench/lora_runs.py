"""Two real demo runs side by side for bench.lora (`--runs=LORA_WORKDIR,FULL_WORKDIR`):

    python -m learner_jax.train --config=configs/tiny_arith_lora.py --workdir=/tmp/l
    python -m learner_jax.train --config=configs/tiny_arith.py --workdir=/tmp/f
    python -m bench.lora --out=F.json --runs=/tmp/l,/tmp/f

Read from each workdir (what the training binary wrote, nothing re-run):
- held-out accuracy before RL and at the end (eval.jsonl);
- bytes per version: median `bridge/version_bytes` over the RL steps (metrics.jsonl);
- swap time: median of each worker's (first seen serving v) - (v announced) over every
  (worker, version) in swaps.jsonl: the fetch + load + canary a version costs a worker,
  plus up to one lease poll;
- learner step time: median `time/step_s` of the RL steps; RL wall: first to last RL line;
- learner memory: the learner process's peak RSS when bench/lora_demo.py ran the arm
  (`bench_rss.json`, NaN otherwise); bench.lora's learner arm measures the JAX side
  (state bytes, XLA temp bytes); pass the demo's shape (--layers=4 --hidden=128) to match.
`table` prints the two runs side by side, held-out accuracy as before -> final (best).
"""

from __future__ import annotations

import json
import os

import numpy as np


def _jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_stats(workdir: str) -> dict:
    """The numbers of one run (see the module docstring); raises on a run with no RL."""
    metrics = _jsonl(os.path.join(workdir, "metrics.jsonl"))
    rl = [r for r in metrics if r.get("phase") == "rl"]
    if not rl:
        raise ValueError(f"{workdir} has no RL steps in metrics.jsonl")
    evals = _jsonl(os.path.join(workdir, "eval.jsonl"))
    before = [e["accuracy"] for e in evals if e.get("tag") == "before"]
    rss = _jsonl(os.path.join(workdir, "bench_rss.json"))
    swaps = _jsonl(os.path.join(workdir, "swaps.jsonl"))
    lat = [s["seen_at"] - s["published_at"] for s in swaps if s.get("published_at")]
    vbytes = [r["bridge/version_bytes"] for r in rl if "bridge/version_bytes" in r]
    times = [r["time/wall"] for r in rl if "time/wall" in r]
    return {
        "heldout_before": before[0] if before else float("nan"),
        "heldout_final": evals[-1]["accuracy"] if evals else float("nan"),
        "heldout_best": max(e["accuracy"] for e in evals) if evals else float("nan"),
        "version_bytes": float(np.median(vbytes)) if vbytes else float("nan"),
        "swap_s_median": float(np.median(lat)) if lat else float("nan"),
        "swaps": len(lat),
        "rl_step_s_median": float(np.median([r["time/step_s"] for r in rl])),
        "rl_steps": len(rl),
        "rl_wall_s": (max(times) - min(times)) if len(times) > 1 else float("nan"),
        "learner_peak_rss_bytes": rss[0]["peak_rss_bytes"] if rss else float("nan"),
    }


def rows(lora_dir: str, full_dir: str) -> tuple[list[dict], dict]:
    """(bench rows, headline additions) of the two runs."""
    out, stats = [], {}
    for arm, workdir in (("lora", lora_dir), ("full", full_dir)):
        stats[arm] = run_stats(workdir)
        out += [{"arm": arm, "what": f"run_{k}", "value": v} for k, v in stats[arm].items()]
    lo, fu = stats["lora"], stats["full"]
    head = {
        "run_version_bytes_ratio": lo["version_bytes"] / fu["version_bytes"],
        "run_swap_ratio": lo["swap_s_median"] / fu["swap_s_median"],
        "run_step_time_ratio": lo["rl_step_s_median"] / fu["rl_step_s_median"],
        "run_heldout_final": {"lora": lo["heldout_final"], "full": fu["heldout_final"]},
    }
    return out, head


def table(stats: dict[str, dict]) -> str:
    """`run_stats` of the arms (lora, full) as a markdown table, one column per arm."""
    arms = list(stats)

    def fmt(key, st):
        v = st[key]
        if key == "heldout_before":
            return f"{v:.3f} -> {st['heldout_final']:.3f} (best {st['heldout_best']:.3f})"
        if key in ("version_bytes", "learner_peak_rss_bytes"):
            return f"{v:,.0f}" if v == v else "n/a"
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    names = {
        "heldout_before": "held-out accuracy, before -> final",
        "version_bytes": "bridge/version_bytes (median)",
        "swap_s_median": "publish -> serving, s (median)",
        "swaps": "(worker, version) swaps",
        "rl_step_s_median": "RL step, s (median)",
        "rl_steps": "RL steps",
        "rl_wall_s": "RL wall, s",
        "learner_peak_rss_bytes": "learner peak RSS, bytes",
    }
    lines = ["| | " + " | ".join(arms) + " |", "|---" * (len(arms) + 1) + "|"]
    for key, name in names.items():
        lines.append(f"| {name} | " + " | ".join(fmt(key, stats[a]) for a in arms) + " |")
    return "\n".join(lines)
