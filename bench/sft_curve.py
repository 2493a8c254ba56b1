"""Held-out accuracy along the SFT warm start, clean teacher vs the demo's sloppy one.

    python -m bench.sft_curve --out=/tmp/sft_curve.json [--steps=2000] [--every=250] \
        [--noise 0 0.7] [--config=configs/tiny_arith.py] [--set KEY=VALUE ...]

For each `task.sft_label_noise` value, one SFT run of the config's model from the same
seed (same init, same problem stream), with greedy held-out accuracy (learner_jax/
evaluate.py) every `--every` steps. The clean arm says what SFT alone reaches; the noisy
arm is where the demo's RL starts. Prints a table (rows = steps, one column per arm) and
writes JSON {arm: [[step, accuracy, loss], ...]}.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_config(path: str, overrides: list[str]):
    from learner_jax import config_file

    config = config_file.load_config(os.path.join(ROOT, path))
    for kv in overrides:
        key, value = kv.split("=", 1)
        *parents, leaf = key.split(".")
        node = config
        for name in parents:
            node = node[name]
        try:
            node[leaf] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            node[leaf] = value
    return config


def sft_curve(config, workdir: str, steps: int, every: int) -> list[list[float]]:
    from bridge.contracts.prompt import TextCodec
    from learner_jax import train
    from learner_jax.evaluation import evaluate
    from learner_jax.learner import Learner
    from learner_jax.training.sft_data import SFTStream

    config.sft.steps = steps
    config.checkpoint.interval = 10**9  # nothing to resume here
    learner = Learner(config, workdir)
    task = train.make_task(config)
    codec = TextCodec(learner.hf_dir)
    b = config.batch
    evaluator = evaluate.Evaluator(
        learner.model_cfg, codec, task, evaluate.EvalConfig(b.max_prompt_len, b.max_answer_len)
    )
    stream = SFTStream(
        task, codec, config.sft.batch_size, b.max_prompt_len + b.max_answer_len, config.seed
    )
    rows, t0 = [], time.perf_counter()
    try:
        while learner.step < steps:
            metrics = learner.train_step(next(stream))
            if learner.step % every == 0 or learner.step == steps:
                acc = evaluator.accuracy(learner.state.params, learner.mesh, learner.rules)
                rows.append([learner.step, acc, float(metrics["loss"])])
                print(f"  step {learner.step:5d} acc {acc:.3f} ({time.perf_counter() - t0:.0f}s)")
    finally:
        learner.close()
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--every", type=int, default=250)
    p.add_argument("--noise", type=float, nargs="+", default=[0.0, 0.7])
    p.add_argument("--config", default="configs/tiny_arith.py")
    p.add_argument("--workdir", default="/tmp/echo2_sft_curve")
    p.add_argument("--set", nargs="*", default=[], help="extra KEY=VALUE config overrides")
    a = p.parse_args()

    results = {}
    for noise in a.noise:
        arm = f"noise_{noise:g}"
        wd = os.path.join(a.workdir, arm)
        shutil.rmtree(wd, ignore_errors=True)
        config = load_config(a.config, [*a.set, f"task.sft_label_noise={noise}"])
        print(f"{arm}: {a.steps} SFT steps", flush=True)
        results[arm] = sft_curve(config, wd, a.steps, a.every)

    arms = list(results)
    print(f"{'step':>6}" + "".join(f"{x:>14}" for x in arms))
    for i, row in enumerate(results[arms[0]]):
        print(f"{row[0]:>6}" + "".join(f"{results[x][i][1]:>14.3f}" for x in arms))
    results["config"] = {"config": a.config, "steps": a.steps, "overrides": a.set}
    with open(a.out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
