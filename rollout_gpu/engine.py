"""The rollout engine interface: what the worker needs from an inference engine.

Modelled on tunix's `BaseRollout`. generate.py, canary.py, weight_swap.py and worker.py
are written against `RolloutEngine` only; every detail of one inference library lives in
its implementation (`rollout_gpu/vllm_engine.py: VllmEngine`, the only one today).

    engine = VllmEngine.start(model_dir, dtype="float32", max_model_len=512)
    [[c0, c1]] = engine.generate([SampleRequest(prompt_token_ids=ids, n=2, max_tokens=8)])
    c0.token_ids, c0.logprobs, c0.finish_reason
    engine.prompt_logprobs([ids])          # [T-1] log-prob of each token given its prefix
    engine.load_weights([(hf_name, torch_tensor), ...])   # None: the model dir's weights

Token ids are the engine tokenizer's; weights are HF-named torch tensors in `[out, in]`
layout, one per HF name (q/k/v and gate/up separate), as they cross the bridge.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from bridge.model.config import ModelConfig


class GenerationAborted(RuntimeError):
    """`should_abort` turned true mid-generation; the requests were aborted, nothing scored."""


class GenerationError(RuntimeError):
    """The lease cannot be served as asked (a task this worker cannot build, a prompt too
    long for the engine), or the engine returned something a trajectory cannot be made of
    (an aborted sample, a missing log-prob, one that is not finite and <= 0)."""


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    """`n` samples continuing one prompt. `top_k` <= 0 and `min_p` 0 are off; `seed` keys the
    sampling noise (sample i: seed + i, rollout_gpu/verifiable_sampler.py); None draws
    fresh random keys."""

    prompt_token_ids: Sequence[int]
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    stop_token_ids: Sequence[int] = ()
    seed: int | None = None


@dataclasses.dataclass(frozen=True)
class Completion:
    """One sample: its tokens (EOS/stop token included), the sampled token's log-prob at
    each position (None when the engine returned none for some token), and why it ended:
    "stop" (EOS or a stop token), "length" (max_tokens), "paused" (`should_pause`: to be
    continued), or anything else for a sample that must not be trained on (e.g. "abort").
    A MoE engine adds the experts each token was routed to."""

    index: int
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None
    # A MoE engine's routing (rollout_gpu/routing_capture.py): int16 [P + C - 1, L, k], the
    # experts of every forwarded position (prompt P, completion C tokens), -1 = unrecorded.
    routed_experts: np.ndarray | None = None


class RolloutEngine(abc.ABC):
    """A running inference engine serving one model whose weights can be replaced in place.

    Not thread-safe: one caller drives it (the worker's main loop).
    """

    # -- model -----------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def tokenizer(self) -> Any:
        """The HF tokenizer of the served model (`encode`, `decode`, `bos_token_id`, len)."""

    @property
    @abc.abstractmethod
    def model_dir(self) -> str:
        """The HF directory the engine was started from (config, tokenizer, first weights)."""

    @property
    @abc.abstractmethod
    def hf_config(self) -> dict:
        """The served model's HF config (config.json) as a dict."""

    @property
    @abc.abstractmethod
    def dtype(self) -> str:
        """The dtype the engine computes in: "float32", "bfloat16" or "float16"."""

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int:
        """The most prompt + completion tokens one sequence may have."""

    @property
    @abc.abstractmethod
    def logprobs_mode(self) -> str:
        """What `Completion.logprobs` holds, in vLLM's terms: "processed_logprobs" (the
        log-softmax after temperature/top-k/top-p: the sampling distribution, what the
        learner recomputes), "raw_logprobs" (before them), or "raw_logits"/
        "processed_logits" (not log-probs at all)."""

    def model_config(self) -> ModelConfig:
        """The architecture the engine runs, from its HF config."""
        try:
            return ModelConfig.from_hf_dict(dict(self.hf_config))
        except (KeyError, ValueError):
            return ModelConfig.from_hf_dir(self.model_dir)

    # -- inference ---------------------------------------------------------------------------
    @abc.abstractmethod
    def generate(
        self,
        requests: Sequence[SampleRequest],
        should_abort: Callable[[], bool] = lambda: False,
        should_pause: Callable[[], bool] = lambda: False,
    ) -> list[list[Completion]]:
        """Samples for every request, in request order (each list ordered by `index`).

        `should_abort()` is polled while generating; when it turns true every request is
        aborted and GenerationAborted raised, leaving the engine idle. `should_pause()` too;
        when it turns true every unfinished request is stopped and returned as sampled so far
        (finish_reason "paused", possibly no tokens), leaving the engine idle: a partial
        rollout continues it after a weight swap (generate.py). GenerationError if the
        engine lost a request.
        """

    @abc.abstractmethod
    def prompt_logprobs(self, token_lists: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Log-prob of every token given its prefix: one float64 [T-1] array per list,
        independent of any sampling setting and of cached state (the canary's probe)."""

    @abc.abstractmethod
    def has_unfinished_requests(self) -> bool:
        """True while requests are queued or running (never, between calls, if idle)."""

    # -- weights -----------------------------------------------------------------------------
    @abc.abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, Any]] | None) -> None:
        """Replace the served weights in place with `(HF name, torch tensor)` pairs, which
        must be the model's complete parameter set (None: the weights in `model_dir`).

        After it returns, generation uses only the new weights (no state computed with the
        old ones, such as cached KV blocks, is reused). If it raises, the engine is usable
        again but its weights are undefined: load a complete set before serving.
        """
