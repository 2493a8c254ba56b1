"""Health curves of RL runs side by side (issue 27's collapse diagnosis): one PNG, one table.

    python -m bench.rl_health --runs=lr1e-3:/tmp/a,fixed:/tmp/b --png=docs/kuhn_collapse.png \
        [--out=F.json]

Reads each workdir's metrics.jsonl (RL rows) and eval.jsonl, and plots per step: exact
expected reward (or held-out accuracy), batch reward, entropy of the sampled tokens, the
largest importance weight, the gradient norm per top-level parameter (grad_norm/*),
advantage health (adv/*) and, on Kuhn, the probability of legal action tokens and the
logit spread at the decision points (eval/legal_mass, eval/logit_std; learner_jax/
diagnostics.py). The table gives each run's first and last evaluation, its best, and the
entropy at the start and the end.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from learner_jax.reporting.metrics import read_jsonl

_RUNS = flags.DEFINE_list("runs", None, "label:workdir,...", required=True)
_PNG = flags.DEFINE_string("png", "rl_health.png", "where to write the plot")
_OUT = flags.DEFINE_string("out", "", "also write the numbers here as JSON")

PANELS = (  # (title, source, keys)
    ("exact expected reward / accuracy", "eval", ("expected_reward", "accuracy")),
    ("batch reward/mean", "rl", ("reward/mean",)),
    ("entropy (sampled tokens, nats)", "rl", ("entropy",)),
    ("is_weight/max", "rl", ("is_weight/max",)),
    ("grad_norm (before clipping)", "rl", ("grad_norm",)),
    ("grad_norm/lm_head or embed", "rl", ("grad_norm/lm_head", "grad_norm/embed")),
    ("adv/zero_groups_frac", "rl", ("adv/zero_groups_frac",)),
    ("eval/legal_mass (Kuhn)", "eval", ("eval/legal_mass",)),
    ("eval/logit_std (Kuhn)", "eval", ("eval/logit_std",)),
)


def load(workdir: str) -> dict:
    rl = [
        r
        for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))
        if r.get("phase") == "rl" and "loss" in r
    ]
    path = os.path.join(workdir, "eval.jsonl")
    evals = read_jsonl(path) if os.path.exists(path) else []
    return {"rl": rl, "eval": evals}


def series(run: dict, source: str, keys) -> tuple[str, list, list]:
    for key in keys:
        rows = [r for r in run[source] if key in r]
        if rows:
            return key, [r["step"] for r in rows], [r[key] for r in rows]
    return "", [], []


def summary(run: dict) -> dict:
    key, _, ys = series(run, "eval", ("expected_reward", "accuracy"))
    ent = [r["entropy"] for r in run["rl"]]
    return {
        "metric": key,
        "first": ys[0] if ys else None,
        "last": ys[-1] if ys else None,
        "best": max(ys) if ys else None,
        "steps": len(run["rl"]),
        "entropy_first": ent[0] if ent else None,
        "entropy_last": ent[-1] if ent else None,
        "entropy_max": max(ent) if ent else None,
    }


def plot(runs: dict[str, dict], png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 3, figsize=(14, 10))
    for ax, (title, source, keys) in zip(axes.flat, PANELS, strict=True):
        for label, run in runs.items():
            key, xs, ys = series(run, source, keys)
            if xs:
                ax.plot(xs, ys, "o-" if source == "eval" else "-", ms=3, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("learner step", fontsize=8)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)


def main(argv):
    del argv
    runs = {}
    for item in _RUNS.value:
        label, _, workdir = item.partition(":")
        runs[label] = load(workdir)
    table = {label: summary(run) for label, run in runs.items()}
    print(f"{'run':<22} {'metric':<16} {'first':>8} {'last':>8} {'best':>8} {'H0':>6} {'Hend':>6}")
    fmt = lambda x: "-" if x is None else f"{x:+.3f}"
    for label, s in table.items():
        print(
            f"{label:<22} {s['metric']:<16} {fmt(s['first']):>8} {fmt(s['last']):>8} "
            f"{fmt(s['best']):>8} {fmt(s['entropy_first']):>6} {fmt(s['entropy_last']):>6}"
        )
    plot(runs, _PNG.value)
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    app.run(main)
