"""Partial rollouts: samples paused mid-generation, continued under a newer version, and
checked token by token under the version each token names.

The session's vLLM engine serves version 0 (its own weights) and generates one lease's groups
with `rollout_gpu.generate.continue_groups`, the worker's path for `rollout.partial=continue`;
a few engine steps in, the newer version 1 (other weights, read from the weight store through
the worker's verified loader) is swapped in and every unfinished sample goes on under it.
The rows are then judged as the learner judges them: each token's behaviour log-prob against
the JAX model's under the version the token names (the audit's re-score reads the versions
back from the store: `VersionRescorer`), and every token's draw recomputed under its version
and its lease's seed (`ExactChecker`).

Would catch: a continuation tagging its tokens with the version the lease started under (or
the new version for the tokens before the swap), a continued sample's log-probs that are not
those of the distribution each token was drawn from (e.g. the continuation's reported for the
whole sample, or the paused part's lost), and a continuation keyed by another seed or
position than the uninterrupted sample's (the exact check refuses the group).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bridge.control.protocol import (
    ConsumedGroup,
    EpisodeSpec,
    PromptGroup,
    SamplingParams,
    Trajectory,
)
from bridge.model import tiny_model
from bridge.store.weight_store import WeightStore
from bridge.tasks.env import Environment, register_env
from learner_jax.model import model
from learner_jax.rl.exact_check import ExactChecker
from learner_jax.rl.rescore import VersionRescorer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOL = 1e-3  # vLLM (fp32) vs an independent fp32 implementation, per token (engine_test)
CFG = tiny_model.tiny_config("qwen3")
MAX_TOKENS, N, SEEDS = 12, 3, (101, 202)
PAUSE_AFTER_STEPS = 4  # engine steps before version 1 is "announced"
WIDTH = 64


@jax.jit
def _logprobs(params, ids, seg):  # ids, seg [1, WIDTH] -> [1, WIDTH - 1]
    pos = jnp.arange(WIDTH - 1, dtype=jnp.int32)[None]
    return model.forward_logprobs(params, CFG, ids[:, :-1], pos, seg[:, :-1], ids[:, 1:])


def learner_logprobs(params, t):
    """The JAX model's log-probs of `t`'s completion under `params` (temperature 1)."""
    p, c = list(t.prompt_token_ids), list(t.completion_token_ids)
    ids = np.zeros((1, WIDTH), np.int32)
    ids[0, : len(p) + len(c)] = p + c
    seg = (np.arange(WIDTH) < len(p) + len(c)).astype(np.int32)[None]
    lp = np.asarray(jax.device_get(_logprobs(params, ids, seg)), np.float64)
    return lp[0, len(p) - 1 : len(p) + len(c) - 1]


def _groups(prompts=([1, 17, 23, 5, 9, 31], [1, 8, 8, 40, 2]), max_tokens=MAX_TOKENS, **kw):
    """One group per seed; `kw` (task, episode) for episodes."""
    return [
        PromptGroup(
            group_id=seed,
            prompt_id=f"p{seed}",
            task=kw.get("task", "test"),
            prompt="",
            prompt_token_ids=ids,
            n=N,
            # no stop token: every sample runs its whole budget, so each spans the swap
            sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed),
            episode=kw.get("episode"),
        )
        for seed, ids in zip(SEEDS, prompts, strict=True)
    ]


def _two_versions(tmp_path, engine):
    """A store with versions 0 and 1 (far apart), the engine's version record and a `swap`
    that loads version 1 through the worker's verified loader."""
    from rollout_gpu import weight_swap

    store = WeightStore(f"file://{tmp_path}/store")
    weights = {
        0: tiny_model.random_hf_weights(CFG, seed=0),
        1: tiny_model.random_hf_weights(CFG, seed=5, std=0.1),  # far from version 0
    }
    for v, w in weights.items():
        store.publish(v, v, w.items(), model_config=CFG.to_hf_dict(), dtype="float32")
    current = weight_swap.EngineVersion()

    def swap():
        weight_swap.load_version(engine, store, 1, current)
        return current.version

    return store, weights, current, swap


def _consumed(results, groups, versions_of=None):
    """ConsumedGroups of the worker's results (tags replaced by `versions_of(t)` if given)."""
    out = []
    for r, g in zip(results, groups, strict=True):
        trajs = [
            Trajectory(
                **{**t.model_dump(), "versions": versions_of(t) if versions_of else t.versions},
                reward=0.0,
            )
            for t in r.trajectories
        ]
        out.append(ConsumedGroup(
            group_id=g.group_id, prompt_id=g.prompt_id, prompt="", answer="",
            trajectories=trajs, worker_id="w", engine_dtype="float32",
            sampling_seed=g.sampling.seed,
        ))  # fmt: skip
    return out


def test_continued_samples_carry_each_tokens_version_and_log_prob(vllm_engine, tmp_path):
    from rollout_gpu import generate, weight_swap

    store, weights, current, swap = _two_versions(tmp_path, vllm_engine)
    polls = [0]

    def due():  # version 1 "announced" a few engine steps into the lease
        polls[0] += 1
        return current.version == 0 and polls[0] > PAUSE_AFTER_STEPS

    groups = _groups()
    try:
        weight_swap.load_version(vllm_engine, store, 0, current)
        results = generate.continue_groups(
            vllm_engine, groups, 0, generate.Swaps(due=due, swap=swap)
        )
    finally:  # the session engine goes back to the weights it was started with
        weight_swap.restore(vllm_engine, weight_swap.EngineVersion())

    trajs = [t for r in results for t in r.trajectories]
    assert len(trajs) == len(SEEDS) * N
    for t in trajs:
        assert len(t.completion_token_ids) == MAX_TOKENS and t.finish_reason == "length"
        k = t.versions.index(1)  # tokens before the swap: version 0; after: version 1
        assert 0 < k < MAX_TOKENS and t.versions == [0] * k + [1] * (MAX_TOKENS - k), t.versions

    # The audit: each token's behaviour log-prob is the JAX model's under the version it names.
    rescorer = VersionRescorer(store, CFG, every=1, max_rows=8)
    params = {v: rescorer.params(v) for v in weights}
    for t in trajs:
        behaviour = np.asarray(t.logprobs, np.float64)
        tags = np.asarray(t.versions)
        under = {v: learner_logprobs(params[v], t) for v in weights}
        own = np.where(tags == 0, under[0], under[1])
        assert np.abs(behaviour - own).max() <= TOL, np.abs(behaviour - own).max()
        # the other version's log-probs are far off on either side of the swap
        for v in weights:
            assert np.abs(behaviour - under[v])[tags != v].min() > 10 * TOL
    honest = rescorer.maybe(1, _consumed(results, groups), current_version=2)
    assert sorted(s.version for s in honest) == [0, 1]
    assert sum(s.tokens for s in honest) == len(trajs) * MAX_TOKENS  # every token, once
    for s in honest:
        assert s.sum_k3 / s.tokens < 1e-6 and abs(s.sum_logratio) / s.tokens < TOL, s

    # The exact check: every draw recomputed under its version and the lease's seed.
    checker = ExactChecker(rescorer.params, CFG, temperature=1.0, rows_per_call=8, chunk=8)
    verdict = checker.check(_consumed(results, groups))
    assert verdict.refused == set(), verdict.metrics
    assert verdict.metrics["exact/checked_tokens"] == len(trajs) * MAX_TOKENS
    for wrong in (lambda t: [0] * len(t.versions), lambda t: [1] * len(t.versions)):
        assert checker.check(_consumed(results, groups, wrong)).refused == set(SEEDS)


@register_env("partial_count_test", max_turns=3, turn_max_tokens=4)
class CountTurns(Environment):
    """Three model turns with a fixed observation between them: every episode has turns on
    both sides of a swap after its first turn."""

    hidden_state = False

    def reset(self, seed: int) -> str:
        self.k = 0
        return "count"

    def step(self, action: str) -> tuple[str, float, bool]:
        self.k += 1
        return f" next {self.k}", 0.0, self.k >= 3


def test_episodes_take_the_newer_version_between_turns(vllm_engine, tmp_path):
    """Multi-turn episodes with `rollout.partial=continue`: the version announced during the
    first turn is loaded before the second, every later model token is tagged with it (the
    first observation with the first turn's), and the audit and the exact check accept each
    model token under the version it names and refuse any other tagging.

    Would catch: episodes tagged with the lease's version throughout (the exact check
    refuses them), a swap not taken between turns, and observations tagged with the next
    turn's version (asserted tag by tag)."""
    from rollout_gpu import generate, weight_swap

    store, weights, current, swap = _two_versions(tmp_path, vllm_engine)
    spec = EpisodeSpec(
        env="partial_count_test", module=__name__, seed=3, max_turns=3, max_tokens=40
    )
    groups = _groups(([1, 17, 23, 5], [1, 8, 40, 2, 9]), 4, task="partial_count_test", episode=spec)
    try:
        weight_swap.load_version(vllm_engine, store, 0, current)
        # polled between turns only: version 1 is ready from the first turn's end
        swaps = generate.Swaps(due=lambda: current.version == 0, swap=swap)
        results = generate.continue_groups(vllm_engine, groups, 0, swaps)
    finally:
        weight_swap.restore(vllm_engine, weight_swap.EngineVersion())

    trajs = [t for r in results for t in r.trajectories]
    assert len(trajs) == len(SEEDS) * N
    for t in trajs:
        segs = t.segments()
        assert [m for m, _ in segs] == [1, 0, 1, 0, 1], segs
        first = len(segs[0][1]) + len(segs[1][1])  # the first turn and its observation
        assert t.versions == [0] * first + [1] * (len(t.versions) - first), t.versions

    rescorer = VersionRescorer(store, CFG, every=1, max_rows=8)
    params = {v: rescorer.params(v) for v in weights}
    for t in trajs:
        mask = np.asarray(t.completion_mask) == 1
        tags = np.asarray(t.versions)
        under = {v: learner_logprobs(params[v], t) for v in weights}
        own = np.where(tags == 0, under[0], under[1])
        gap = np.abs(np.asarray(t.logprobs, np.float64) - own)[mask]
        assert gap.max() <= TOL, gap.max()
    model_tokens = sum(sum(t.completion_mask) for t in trajs)
    checker = ExactChecker(rescorer.params, CFG, temperature=1.0, rows_per_call=8, chunk=8)
    verdict = checker.check(_consumed(results, groups))
    assert verdict.refused == set(), verdict.metrics
    assert verdict.metrics["exact/checked_tokens"] == model_tokens
    for wrong in (lambda t: [0] * len(t.versions), lambda t: [1] * len(t.versions)):
        assert checker.check(_consumed(results, groups, wrong)).refused == set(SEEDS)
