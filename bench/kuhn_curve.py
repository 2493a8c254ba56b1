"""Kuhn poker learning curve of a finished (or running) run: table, CSV and plot.

    python -m bench.kuhn_curve --workdir=/tmp/echo2_kuhn [--out=F.json]

Reads `<workdir>/eval.jsonl` (the exact expected reward per hand at each evaluation,
learner_jax/evaluation/evals.py) and `<workdir>/metrics.jsonl` (the sampled `reward/mean`), adds
the untrained policy's exact value (the run's initial model, `<workdir>/model`, before any
SFT: step 0), prints a table, and writes `kuhn_poker.csv` and `kuhn_poker.png` (exact
expected reward, sampled batch reward and the best response's optimum against steps) into
the workdir.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

from learner_jax.reporting.metrics import read_jsonl

_WORKDIR = flags.DEFINE_string("workdir", None, "the run's workdir", required=True)
_OUT = flags.DEFINE_string("out", "", "also write the numbers here as JSON")
_POLICY = flags.DEFINE_integer(
    "policy", -1, "also print each decision's action probabilities at this step (-1 = last)"
)


def policy_table(row: dict) -> list[str]:
    """Lines: each information set, the policy's P(c), P(b), P(other = fold) at one eval
    row, the best response's action there and its probability (where the policy is wrong).
    """
    from bridge.tasks.kuhn_poker import INFO_SETS, best_response

    _, best = best_response()
    lines = [f"{'card':>4} {'hist':>4} {'P(c)':>6} {'P(b)':>6} {'fold':>6}  best  P(best)"]
    for (card, hist), p in zip(INFO_SETS, row["action_probs"], strict=True):
        fold = 1.0 - p.get("c", 0.0) - p.get("b", 0.0)
        a = best[(card, hist)]
        # at "" and "c" fold never helps; facing a bet "b" means call: the game's _legal
        pa = {"c": p.get("c", 0.0) + (p.get("b", 0.0) if hist.endswith("b") else 0.0),
              "b": p.get("b", 0.0), "f": fold}[a]  # fmt: skip
        lines.append(
            f"{card:>4} {hist or '-':>4} {p.get('c', 0):6.3f} {p.get('b', 0):6.3f} "
            f"{fold:6.3f}  {a:>4}  {pa:6.3f}"
        )
    return lines


def untrained_value(workdir: str) -> float | None:
    """Exact expected reward of the run's initial weights (`<workdir>/model`), if there."""
    model_dir = os.path.join(workdir, "model")
    if not os.path.exists(os.path.join(model_dir, "config.json")):
        return None
    import jax

    from bridge.contracts.prompt import TextCodec
    from bridge.tasks import make_task
    from learner_jax.evaluation import evaluate
    from learner_jax.model import hf_import, sharding

    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, jax.devices()[:1])
    cfg, params = hf_import.load_hf_params(model_dir, mesh)
    task = make_task("kuhn_poker", turn_max_tokens=1)
    return evaluate.exact_evaluator(cfg, TextCodec(model_dir), task).expected_reward(params)


def curve(workdir: str) -> dict:
    evals = [r for r in read_jsonl(os.path.join(workdir, "eval.jsonl")) if "expected_reward" in r]
    if not evals:
        raise SystemExit(f"{workdir}/eval.jsonl has no expected_reward rows (not a Kuhn run?)")
    rl = {
        r["step"]: r["reward/mean"]
        for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))
        if r.get("phase") == "rl" and "reward/mean" in r
    }
    points = [(r["step"], r["expected_reward"], r["tag"]) for r in evals]
    init = untrained_value(workdir)
    if init is not None and points[0][0] > 0:  # SFT ran first: its start is not in eval.jsonl
        points.insert(0, (0, init, "untrained"))
    return {
        "optimum": evals[0]["optimum"],
        "before": points[0][1],  # the untrained policy when known, else the first eval
        "first_eval": evals[0]["expected_reward"],  # after SFT, if the run had one
        "after": points[-1][1],
        "best": max(p[1] for p in points),
        "evals": [{"step": s, "expected_reward": v, "tag": t} for s, v, t in points],
        "batch_reward": [{"step": s, "reward_mean": v} for s, v in sorted(rl.items())],
    }


def write(workdir: str, c: dict) -> None:
    with open(os.path.join(workdir, "kuhn_poker.csv"), "w") as f:
        f.write("step,expected_reward,optimum\n")
        for e in c["evals"]:
            f.write(f"{e['step']},{e['expected_reward']:.6f},{c['optimum']:.6f}\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    b = c["batch_reward"]
    ax.plot(
        [x["step"] for x in b],
        [x["reward_mean"] for x in b],
        alpha=0.35,
        label="batch reward/mean (sampled)",
    )
    ax.plot(
        [e["step"] for e in c["evals"]],
        [e["expected_reward"] for e in c["evals"]],
        "o-",
        label="exact expected reward",
    )
    ax.axhline(
        c["optimum"], color="k", ls="--", label=f"optimum (best response) {c['optimum']:+.3f}"
    )
    ax.set_xlabel("learner step")
    ax.set_ylabel("chips per hand")
    ax.set_title("Kuhn poker vs a fixed opponent")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(os.path.join(workdir, "kuhn_poker.png"), dpi=120)
    plt.close(fig)


def main(argv):
    del argv
    c = curve(_WORKDIR.value)
    print(f"{'step':>6} {'expected':>9}   (optimum {c['optimum']:+.4f})")
    for e in c["evals"]:
        print(f"{e['step']:>6} {e['expected_reward']:>+9.4f}  {e['tag']}")
    print(
        f"before {c['before']:+.4f}  first eval (after SFT) {c['first_eval']:+.4f}  "
        f"after {c['after']:+.4f}  best {c['best']:+.4f}  optimum {c['optimum']:+.4f}"
    )
    rows = [
        r
        for r in read_jsonl(os.path.join(_WORKDIR.value, "eval.jsonl"))
        if "action_probs" in r and _POLICY.value in (-1, r["step"])
    ]
    if rows:
        print(f"decisions at step {rows[-1]['step']}:")
        print("\n".join(policy_table(rows[-1])))
    write(_WORKDIR.value, c)
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(c, f, indent=1)


if __name__ == "__main__":
    app.run(main)
