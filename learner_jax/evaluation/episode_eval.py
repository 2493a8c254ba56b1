"""Held-out accuracy of a multi-turn environment task, episode by episode, in JAX.

    ev = EpisodeEvaluator(learner.model_cfg, codec, task, eval_cfg)   # an EnvTask
    ev.summary(params, mesh, rules)["eval/accuracy"]

The single-turn `Evaluator` scores one completion; an environment (a tool task: call,
result, answer) needs its turns played. Each held-out episode is played as a worker plays
it (rollout_gpu/episodes.py), by appending ids: the prompt ids, then per turn the policy's
greedy (or sampled) ids decoded by the same jitted KV-cache decoder (`kv_decode`), the
end-of-turn token when the turn stopped on it, and the environment's observation encoded
on its own (after the template's end-of-turn token when `turn_max_tokens` cut the turn:
chat_turns.py `cut_turn_close`); the environment sees each turn decoded with special
tokens skipped. The reward is the environment's own (`EnvTask.episode`, the trusted
replay, on the draws the episode was played with); accuracy is the share of episodes
with reward >= 1. The context buffer is `max_prompt_len +
max_answer_len` (the run's whole episode), each turn `turn_max_tokens` long.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from bridge.contracts import pass_at_k
from bridge.tasks import EnvTask
from bridge.tasks.chat_turns import cut_turn_close
from learner_jax.evaluation.evaluate import EvalConfig, Evaluator
from learner_jax.model import sharding


class EpisodeEvaluator(Evaluator):
    def __init__(self, cfg, codec, task: EnvTask, eval_cfg: EvalConfig):
        if not isinstance(task, EnvTask):
            raise TypeError(f"task {task.name!r} is not an environment task")
        self.context = eval_cfg.max_prompt_len + eval_cfg.max_new_tokens
        turn_cfg = dataclasses.replace(
            eval_cfg, max_prompt_len=self.context, max_new_tokens=task.turn_max_tokens
        )
        super().__init__(cfg, codec, task, turn_cfg)

    def _decode(self, rows, params, mesh, rules) -> list[list[int]]:
        saved = self._rows
        try:
            self._rows = rows
            return self.completion_ids(params, mesh, rules)
        finally:
            self._rows = saved

    def episodes(
        self, params, mesh=None, rules=sharding.DEFAULT_RULES
    ) -> list[tuple[float, list[str]]]:
        """(reward, the model's turns as text) of every held-out episode (n per prompt)."""
        task, codec, n = self.task, self.codec, self.eval_cfg.samples
        prompts = [p for p in self.prompts for _ in range(n)]
        rows = [list(r) for r in self._rows]
        envs = [task.new_env() for _ in prompts]
        for env, p in zip(envs, prompts, strict=True):
            env.reset(task.seed_of(p))
        actions: list[list[str]] = [[] for _ in prompts]
        drawn: list[list] = [[] for _ in prompts]  # a nondeterministic tool's results
        live = list(range(len(prompts)))
        for _ in range(task.max_turns):
            if not live:
                break
            turns = self._decode([rows[i] for i in live], params, mesh, rules)
            still = []
            for i, ids in zip(live, turns, strict=True):
                # completion_ids cuts at EOS: the engine's turn kept it, so does this one.
                stopped = len(ids) < task.turn_max_tokens
                actions[i].append(codec.decode(ids))
                obs, _, done = envs[i].step(actions[i][-1])
                drawn[i].append(envs[i].drawn())
                turn = ids + ([codec.eos_id] if stopped else [])
                rows[i] += turn
                if done:
                    continue
                # A turn cut at turn_max_tokens is closed first, as a worker closes it.
                obs_ids = codec.encode(cut_turn_close(envs[i], turn, codec.encode) + obs)
                if len(rows[i]) + len(obs_ids) + 1 > self.context:
                    continue  # no room for another turn: unfinished
                rows[i] += obs_ids
                still.append(i)
            live = still
        return [
            (task.episode(p, a, d).reward, a)
            for p, a, d in zip(prompts, actions, drawn, strict=True)
        ]

    def summary(self, params, mesh=None, rules=sharding.DEFAULT_RULES) -> dict:
        results = self.episodes(params, mesh, rules)
        n = self.eval_cfg.samples
        counts = [
            (n, sum(r >= 1.0 for r, _ in results[i * n : (i + 1) * n]))
            for i in range(len(self.prompts))
        ]
        return {
            "eval/accuracy": float(sum(c for _, c in counts) / (n * len(counts))),
            "eval/pass@1": pass_at_k.mean_pass_at_k(counts, 1),
            "eval/pass@k": pass_at_k.mean_pass_at_k(counts, n),
            "eval/mean_turns": float(np.mean([len(a) for _, a in results])),
        }
