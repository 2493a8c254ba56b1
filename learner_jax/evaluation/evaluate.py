"""Held-out accuracy of the learner's policy: greedy decoding with the Flax model, in JAX.

    acc = Evaluator(learner.model_cfg, codec, task, EvalConfig(...)).accuracy(params, mesh, rules)

The task's fixed `eval_prompts()` are tokenized like the workers see them
(`TextCodec.encode_prompt` in the run's prompt format: BOS + text, or the chat template;
bridge/contracts/prompt.py), left-padded to `max_prompt_len`, and decoded for
`max_new_tokens` steps in one jitted loop with a KV cache (`kv_decode.py`: prefill, then
one token per step; stops once every row has emitted EOS). Shapes are fixed (one compile
per run). This stays independent of the worker's decoding code (vLLM), so the held-out
number checks the rollout plane rather than repeating it.

`EvalConfig(kv_cache=False)` selects the cache-free reference (`full_forward_fn`): every
step runs the full [B, P + A] forward and reads the logits at the current position, so
its work grows as A^2 (a 576-token answer: minutes on the tiny model instead of seconds,
`python -m bench.eval`). It is kept as the check of the cached decoder (same tokens,
tests/learner_jax/model/kv_decode_test.py). Its buffer's not-yet-generated positions are marked
as part of the sequence from the start: attention is causal, so a position's logits never
depend on later (still empty) slots, and positions/masks stay constant across steps.

`temperature` > 0 samples (tempered softmax, `jax.random.categorical` with the step's key
folded from one key), `n` samples per prompt; 0 is greedy (one sample). Both paths draw
the same tokens from the same key.

Scoring is the task's own reward (`bridge.tasks.score`) on the decoded text up to EOS;
accuracy is the fraction of samples with reward >= 1; `summary` adds the fleet's metrics
(eval/pass@1, eval/pass@k with k = n, unbiased; eval/mean_length in tokens).

Exact expected reward (`expected_reward`): a multi-turn task whose decisions are single
tokens and whose game is small (Kuhn poker; `bridge.tasks.env.ExactEval`) is evaluated
exactly instead of by sampling: one forward pass over every decision point's transcript
gives the policy's probability of each action token (temperature 1, the sampling
distribution), and the environment enumerates deals and opponent moves with them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from bridge import tasks
from bridge.contracts import pass_at_k
from bridge.model.config import ModelConfig
from learner_jax.model import kv_decode, model, sharding
from learner_jax.training import diagnostics


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    max_prompt_len: int = 32
    max_new_tokens: int = 16
    batch_size: int = 256  # prompts per jitted call (padded up to a fixed shape)
    dtype: str = "float32"
    kv_cache: bool = True  # False: the cache-free reference decoder (quadratic work)
    temperature: float = 0.0  # 0 = greedy
    n: int = 1  # samples per prompt (greedy: always 1)
    seed: int = 0  # the sampling key's seed (temperature > 0)

    def __post_init__(self):
        if self.max_prompt_len < 1 or self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError(f"bad eval config {self}")
        if self.temperature < 0:
            raise ValueError(f"eval temperature must be >= 0, got {self.temperature}")
        if self.n < 1:
            raise ValueError(f"eval n must be >= 1, got {self.n}")

    @property
    def samples(self) -> int:
        return 1 if self.temperature == 0.0 else self.n


def full_forward_fn(
    cfg: ModelConfig, prompt_len: int, new_tokens: int, dtype=jnp.float32, temperature=0.0
):
    """The cache-free reference: (params, tokens [B, P + A], segment_ids [B, P + A], key)
    -> tokens with A decoded steps (greedy at temperature 0), the full forward per step."""
    net = model.Transformer(cfg, dtype=dtype)

    def decode(params, tokens, segment_ids, key):
        positions = model.positions_from_segments(segment_ids)  # [B, P + A]

        def body(i, toks):
            logits = net.apply({"params": params}, toks, positions, segment_ids)  # [B, L, V]
            cur = prompt_len - 1 + i
            at = jax.lax.dynamic_index_in_dim(logits, cur, 1, False)  # [B, V]
            nxt = kv_decode.pick(at, jax.random.fold_in(key, i), temperature)
            return jax.lax.dynamic_update_index_in_dim(toks, nxt.astype(toks.dtype), cur + 1, 1)

        return jax.lax.fori_loop(0, new_tokens, body, tokens)

    return jax.jit(decode)


class Evaluator:
    """Held-out accuracy of a param tree on a task's eval prompts (one compile per shape)."""

    def __init__(
        self,
        cfg: ModelConfig,
        codec,
        task: tasks.Task,
        eval_cfg: EvalConfig,
    ):
        self.cfg, self.codec, self.task, self.eval_cfg = cfg, codec, task, eval_cfg
        self.prompts = task.eval_prompts()
        if not self.prompts:
            raise ValueError(f"task {task.name!r} has no held-out prompts")
        p, a = eval_cfg.max_prompt_len, eval_cfg.max_new_tokens
        dt, temp = jnp.dtype(eval_cfg.dtype), eval_cfg.temperature
        if eval_cfg.kv_cache:
            self._fn = kv_decode.decode_fn(
                cfg, p, a, dt, temp, eos_id=codec.eos_id, pad_id=codec.pad_id
            )
        else:
            self._fn = full_forward_fn(cfg, p, a, dt, temp)
        self._rows = [self._row(x.text) for x in self.prompts for _ in range(eval_cfg.samples)]
        # One fixed call shape: the whole eval set when it fits, rounded up to 8 rows so
        # the batch splits over any data x fsdp mesh of up to 8 devices.
        self._batch = min(eval_cfg.batch_size, -(-len(self._rows) // 8) * 8)

    def _row(self, text: str) -> list[int]:
        ids = self.codec.encode_prompt(text)
        if len(ids) > self.eval_cfg.max_prompt_len:
            raise ValueError(
                f"eval prompt {text!r} has {len(ids)} tokens > max_prompt_len "
                f"{self.eval_cfg.max_prompt_len}"
            )
        return ids

    def _arrays(self, rows: Sequence[list[int]], size: int):
        p = self.eval_cfg.max_prompt_len
        width = p if self.eval_cfg.kv_cache else p + self.eval_cfg.max_new_tokens
        tokens = np.full((size, width), self.codec.pad_id, np.int32)
        seg = np.zeros((size, width), np.int32)
        for i, ids in enumerate(rows):
            tokens[i, p - len(ids) : p] = ids  # left-padded: the prompt ends at p - 1
            seg[i, p - len(ids) :] = 1  # (cache-free: the answer slots too)
        return tokens, seg

    def completions(self, params, mesh=None, rules=sharding.DEFAULT_RULES) -> list[str]:
        """Completion text of every eval prompt (special tokens dropped, cut at EOS)."""
        return [self.codec.decode(ids) for ids in self.completion_ids(params, mesh, rules)]

    def completion_ids(self, params, mesh=None, rules=sharding.DEFAULT_RULES) -> list[list[int]]:
        """Completion token ids of every eval prompt, cut before EOS."""
        p, b = self.eval_cfg.max_prompt_len, self._batch
        key = jax.random.key(self.eval_cfg.seed)
        out = []
        for lo in range(0, len(self._rows), b):
            chunk = self._rows[lo : lo + b]
            tokens, seg = self._arrays(chunk, b)
            step_key = jax.random.fold_in(key, lo)
            with sharding.use_mesh(mesh, rules) if mesh is not None else contextlib.nullcontext():
                gen = self._fn(params, tokens, seg, step_key)
            if not gen.is_fully_addressable:  # rows on other processes' devices
                gen = multihost_utils.process_allgather(gen, tiled=True)
            gen = np.asarray(jax.device_get(gen))[: len(chunk)]
            if not self.eval_cfg.kv_cache:
                gen = gen[:, p:]  # [b, A]
            for row in gen:
                ids = row.tolist()
                if self.codec.eos_id in ids:
                    ids = ids[: ids.index(self.codec.eos_id)]
                out.append(ids)
        return out

    def accuracy(self, params, mesh=None, rules=sharding.DEFAULT_RULES) -> float:
        return self.summary(params, mesh, rules)["eval/accuracy"]

    def summary(self, params, mesh=None, rules=sharding.DEFAULT_RULES) -> dict:
        """eval/accuracy (share of correct samples), eval/pass@1, eval/pass@k (k = the
        samples per prompt), eval/mean_length (completion tokens, EOS not counted)."""
        ids = self.completion_ids(params, mesh, rules)
        n = self.eval_cfg.samples
        counts = []
        for i, pr in enumerate(self.prompts):
            texts = [self.codec.decode(x) for x in ids[i * n : (i + 1) * n]]
            counts.append((n, sum(tasks.score(self.task, pr, t) >= 1.0 for t in texts)))
        return {
            "eval/accuracy": float(sum(c for _, c in counts) / (n * len(counts))),
            "eval/pass@1": pass_at_k.mean_pass_at_k(counts, 1),
            "eval/pass@k": pass_at_k.mean_pass_at_k(counts, n),
            "eval/mean_length": float(np.mean([len(x) for x in ids])),
        }


def next_token_fn(cfg: ModelConfig, dtype=jnp.float32):
    """(params, tokens [B, L], segment_ids [B, L], last [B]) -> log-probs [B, V] of the token
    after position `last` of each (right-padded) row."""
    net = model.Transformer(cfg, dtype=dtype)

    def fn(params, tokens, segment_ids, last):
        positions = model.positions_from_segments(segment_ids)  # [B, L]
        logits = net.apply({"params": params}, tokens, positions, segment_ids)  # [B, L, V]
        at = jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]  # [B, V]
        return jax.nn.log_softmax(at.astype(jnp.float32), axis=-1)

    return jax.jit(fn)


class ExactEvaluator:
    """The policy's exact expected reward on a task with `task.exact_eval()` (see the
    module docstring); `optimum` is the best any policy reaches."""

    def __init__(self, cfg: ModelConfig, codec, exact, dtype: str = "float32"):
        self.codec, self.exact, self.optimum = codec, exact, exact.optimum
        # Every token that means an action when sampled as a whole turn ("c" and "C" both
        # check): the action's probability is the sum over them.
        self.action_ids: dict[str, list[int]] = {}
        for t in range(codec.tok.get_vocab_size()):
            a = exact.parse(codec.decode([t]))
            if a is not None:
                self.action_ids.setdefault(a, []).append(t)
        rows = []
        for pieces in exact.transcripts:
            ids = codec.encode_prompt(pieces[0])
            for i, text in enumerate(pieces[1:]):
                more = codec.encode(text)
                if i % 2 == 0 and len(more) != 1:
                    raise ValueError(f"action {text!r} is {len(more)} tokens; exact eval needs 1")
                ids += more
            rows.append(ids)
        width = max(map(len, rows))
        size = -(-len(rows) // 8) * 8  # splits over any data x fsdp mesh of up to 8 devices
        self.tokens = np.full((size, width), codec.pad_id, np.int32)
        self.seg = np.zeros((size, width), np.int32)
        self.last = np.zeros((size,), np.int32)
        for i, ids in enumerate(rows):
            self.tokens[i, : len(ids)], self.seg[i, : len(ids)] = ids, 1
            self.last[i] = len(ids) - 1
        self.rows = len(rows)
        self._fn = next_token_fn(cfg, jnp.dtype(dtype))

    def action_probs(self, params, mesh=None, rules=sharding.DEFAULT_RULES) -> list[dict]:
        if mesh is not None:
            with sharding.use_mesh(mesh, rules):
                logp = self._fn(params, self.tokens, self.seg, self.last)
        else:
            logp = self._fn(params, self.tokens, self.seg, self.last)
        p = np.exp(np.asarray(jax.device_get(logp), np.float64))[: self.rows]  # [points, V]
        return [{a: float(row[ids].sum()) for a, ids in self.action_ids.items()} for row in p]

    def expected_reward(self, params, mesh=None, rules=sharding.DEFAULT_RULES) -> float:
        return float(self.exact.value(self.action_probs(params, mesh, rules)))

    def policy_stats(self, params, mesh=None, rules=sharding.DEFAULT_RULES) -> dict:
        """eval/legal_mass, eval/next_token_entropy, eval/logit_std (diagnostics.py) over
        the model's decision points (the rows `action_probs` scores)."""
        with sharding.use_mesh(mesh, rules) if mesh is not None else contextlib.nullcontext():
            logp = self._fn(params, self.tokens, self.seg, self.last)
        logp = np.asarray(jax.device_get(logp), np.float64)[: self.rows]
        legal = sorted(t for ids in self.action_ids.values() for t in ids)
        return diagnostics.policy_stats(logp, legal)


def exact_evaluator(cfg: ModelConfig, codec, task, dtype: str = "float32"):
    """An `ExactEvaluator` for tasks that offer one, else None."""
    exact = getattr(task, "exact_eval", lambda: None)()
    return None if exact is None else ExactEvaluator(cfg, codec, exact, dtype)
