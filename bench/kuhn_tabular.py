"""GRPO vs Dr. GRPO advantages on Kuhn poker with a tabular policy (issue 27's cause B).

    python -m bench.kuhn_tabular [--steps=300] [--lrs=0.03,0.1]

A softmax table over {c, b, f} at each of the 12 information sets plays the real
environment (bridge/tasks/kuhn_poker.py), batched like the learner: 16 seeds per step, each
dealt 16 times (a group shares the deal and the opponent's draws), sequence-mean policy
gradient, Adam. Prints the exact expected reward every 50 steps for each advantage
estimator and rate. With a perfect representation GRPO's per-group std normalization
still stalls well below the optimum (+0.25) and Dr. GRPO reaches it (BUILD_NOTES.md).
Seconds per configuration; numpy only.
"""

from __future__ import annotations

import numpy as np
from absl import app, flags

from bridge.tasks.kuhn_poker import ACTIONS, INFO_SETS, KuhnPoker, expected_reward

_STEPS = flags.DEFINE_integer("steps", 300, "optimizer steps per run")
_LRS = flags.DEFINE_list("lrs", ["0.03", "0.1"], "Adam learning rates")
_SEED = flags.DEFINE_integer("seed", 0, "sampling seed")
IDX = {k: i for i, k in enumerate(INFO_SETS)}


def softmax(t: np.ndarray) -> np.ndarray:
    p = np.exp(t - t.max())
    return p / p.sum()


def play(env: KuhnPoker, seed: int, theta: np.ndarray, rng) -> tuple[float, list]:
    """One episode: (reward, [(information set index, action index, probs)])."""
    env.reset(seed)
    decisions, done, reward = [], False, 0.0
    while not done:
        k = IDX[(env.model, env.history)]
        p = softmax(theta[k])
        a = rng.choice(len(ACTIONS), p=p)
        decisions.append((k, a, p))
        _, reward, done = env.step(ACTIONS[a])
    return reward, decisions


def run(adv: str, lr: float, steps: int, seed: int, groups: int = 16, n: int = 16):
    rng = np.random.default_rng(seed)
    theta = np.zeros((len(INFO_SETS), len(ACTIONS)))
    m, v = np.zeros_like(theta), np.zeros_like(theta)
    env, curve = KuhnPoker(), []
    for step in range(1, steps + 1):
        grad = np.zeros_like(theta)
        for _ in range(groups):
            s = int(rng.integers(1 << 40))
            played = [play(env, s, theta, rng) for _ in range(n)]
            r = np.array([x[0] for x in played])
            a = r - r.mean()
            if adv == "grpo":
                a = a / (r.std() + 1e-6)
            for a_i, (_, decisions) in zip(a, played, strict=True):
                for k, act, p in decisions:
                    e = -p.copy()
                    e[act] += 1.0
                    grad[k] += a_i * e / len(decisions)
        grad /= groups * n  # ascent direction of the sequence-mean objective
        m = 0.9 * m + 0.1 * grad
        v = 0.99 * v + 0.01 * grad**2
        theta += lr * (m / (1 - 0.9**step)) / (np.sqrt(v / (1 - 0.99**step)) + 1e-8)
        if step % 50 == 0:
            value = expected_reward(
                lambda c, h, t=theta: dict(zip(ACTIONS, softmax(t[IDX[(c, h)]]), strict=True))
            )
            curve.append((step, value))
    return curve


def main(argv):
    del argv
    for adv in ("grpo", "dr_grpo"):
        for lr in map(float, _LRS.value):
            curve = run(adv, lr, _STEPS.value, _SEED.value)
            print(f"{adv:8s} lr {lr:<5g} " + " ".join(f"{s}:{v:+.3f}" for s, v in curve))


if __name__ == "__main__":
    app.run(main)
