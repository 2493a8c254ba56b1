"""A worker's seeded sampler built apart from the learner: transformers computes the
logits (float64), numpy the truncation (vLLM's order) and the Gumbel-max choice
(bridge/contracts/gumbel.py). The exact-check tests sample with it and hand the rows to
the learner's checker, which recomputes everything in JAX.

The weights are peaked (std 0.2) so that a worker's choice differs from the sampler's
often enough to show within a few samples.
"""

import numpy as np
import torch
import transformers
from safetensors.numpy import save_file

from bridge.contracts import gumbel
from bridge.control.protocol import ConsumedGroup, Trajectory
from bridge.model import tiny_model

PROMPT = [5, 17, 33, 8]
N, LENGTH = 4, 12


def peaked_weights(seed: int = 3) -> dict[str, np.ndarray]:
    """HF tensors of the tiny Qwen3 model, drawn peaked (float32, as published)."""
    return tiny_model.random_hf_weights(tiny_model.tiny_config("qwen3"), seed=seed, std=0.2)


def model_dir(path: str, weights: dict[str, np.ndarray]) -> str:
    """An HF model directory of the tiny Qwen3 model holding `weights`."""
    tiny_model.make_tiny_model(path, tiny_model.tiny_config("qwen3"))
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    return path


def hf_model(path: str):
    """The model at `path` in transformers, float64 (an fp32 engine's numbers, exactly)."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)


def truncate(z, top_k=-1, top_p=1.0, min_p=0.0, order=("min_p", "top_k", "top_p")):
    """vLLM's processing of tempered logits z [V] in `order` (dropped: -inf), float64."""
    z = z.copy()
    for step in order:
        if step == "min_p" and min_p > 0:
            p = np.exp(z - z.max())
            z[p < min_p * p.max()] = -np.inf
        if step == "top_k" and 0 < top_k < len(z):
            z[z < np.sort(z)[-top_k]] = -np.inf
        if step == "top_p" and top_p < 1.0:
            order_ = np.argsort(z)  # ascending, as vLLM sorts
            p = np.exp(z[order_] - z.max())
            cum = np.cumsum(p / p.sum())
            drop = cum <= 1 - top_p
            drop[-1] = False
            z[order_[drop]] = -np.inf
    return z


def sample(hf, seed, index, temperature=1.0, chooser=None, prefix=(), **trunc):
    """One completion from the independent sampler, continuing PROMPT + `prefix` (a
    multi-turn episode's earlier tokens); `chooser(z, g)` overrides the choice (a
    cheater). Incremental decoding (transformers' KV cache)."""
    lo, hi = gumbel.key_words(seed, index)
    ids, past, fed = list(PROMPT) + list(prefix), None, 0
    for _ in range(LENGTH - len(prefix)):
        with torch.no_grad():
            out = hf(torch.tensor([ids[fed:]]), past_key_values=past, use_cache=True)
        past, fed = out.past_key_values, len(ids)
        z = truncate(out.logits[0, -1].double().numpy() / temperature, **trunc)
        g = gumbel.gumbel(lo, hi, len(ids), len(z))
        ids.append(int(np.argmax(z + g)) if chooser is None else chooser(z, g))
    return ids[len(PROMPT) :]


def group(gid, seed, completions, worker="w1", versions=None, mask=None, dtype="float32"):
    """A consumed group from a worker whose engine is `dtype` (the sampler computes in
    float64: an fp32 engine's numbers, checked with no slack)."""
    trajs = [
        Trajectory(
            prompt_id=f"p{gid}", sample_index=i, prompt_token_ids=PROMPT,
            completion_token_ids=c, logprobs=[-1.0] * len(c),
            versions=versions or [0] * len(c), finish_reason="length", reward=1.0,
            completion_mask=mask,
        )
        for i, c in enumerate(completions)
    ]  # fmt: skip
    return ConsumedGroup(group_id=gid, prompt_id=f"p{gid}", prompt="", answer="",
                         trajectories=trajs, worker_id=worker, sampling_seed=seed,
                         engine_dtype=dtype)  # fmt: skip
