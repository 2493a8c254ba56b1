"""Parameter gradients of the Flax model against torch autograd through transformers.

Every other gradient test compares the JAX model with itself (attention implementations,
remat, packing, micro-batches), so a bug in the model's backward pass that leaves the
forward unchanged passes them all. Here the reference is independent: the same weights
(std 0.2, so the logits are O(1)) loaded into transformers' own torch model in float64,
differentiated by torch autograd, and mapped to Flax names through the layout table
(`bridge/model/layouts.py`). The scalar is sum_{b,t} c[b,t] * log p(target[b,t]) with
random per-token coefficients c, so every position and every vocabulary row of the head
contributes with its own weight.

What it catches, each tried by mutating a copy of the code (12 cases, relative L2 error
of the worst leaf):
- `stop_gradient` on RMSNorm's normaliser rsqrt(mean(x^2) + eps): forward bit-identical,
  23 of 24 Qwen3 leaves wrong (up to 2.9x); all 12 cases fail.
- `stop_gradient` on RMSNorm's scale parameter: forward bit-identical, every norm scale's
  gradient 0 (error 1.0); all 12 cases fail.
- `stop_gradient` on the tied output head (`Embed.attend`): forward bit-identical, the
  embedding's gradient off by 0.43 (Qwen3) / 0.38 (Qwen2); the 9 tied cases fail (Llama's
  head is untied, its 3 cases rightly pass).
- RoPE rotating the other way, and o_proj's heads interleaved on HF's merged N*H axis in
  the layout table (`Transform.from_hf`): the objective itself is off (by 3-15 on
  130-220), all 12 fail.
- packed segments attending to each other, in the 'xla'/'dot_product' mask or in
  'blockwise's own: the objective is off by 1-8 in exactly that mask's packed cases (the
  reference runs every sequence alone, one per row).
Also by construction: a wrong custom VJP in an attention implementation, remat or the
packing gather (`packing.unpack`).

Covered (`CASES`): Qwen3 (q/k norm, tied head), Qwen2 (qkv bias, tied head) and Llama
(untied head); attention 'xla', 'dot_product' and 'blockwise' (blocks of 5, so it tiles,
pads and skips blocks; 'auto' is 'blockwise' on CPU); remat 'none' and 'full'; the padded
layout (one sequence a row, as the reference) and the packed one (`packing.pack_batch`,
two sequences a row, gathered back with `packing.unpack` as the train step does); log-probs
from the full logits and, in two cases (`CHUNKED`), chunk by chunk (`logprob_chunk`).

Tolerance: the JAX model computes in fp32 (RMSNorm, RoPE, scores and log-softmax are
fp32 by construction, so it cannot run in float64); the reference is float64 except
transformers' own fp32 islands (RMSNorm's normalisation, RoPE's cos/sin, softmax). So the
difference is fp32 rounding: unit roundoff u = 2^-24 = 6e-8 per operation, sums of at
most 128 terms (F) in the forward and of 40 targets in a parameter gradient,
random-signed errors growing like sqrt(n) u ~ 1e-6 per stage, a few such stages through
two layers forward and backward. Measured: per-leaf relative error
||g - g_ref|| / ||g_ref|| at most 3.3e-6 over all cases. REL_TOL = 1e-4 leaves 30x for
other CPUs and XLA versions (fusion and FMA change the rounding, not its size) and sits
three orders of magnitude under what the mutations above give.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM

from bridge.model import layouts, tiny_model
from learner_jax.model import model
from learner_jax.training import packing, train_step

FAMILIES = ("qwen3", "qwen2", "llama")
# (family, attention, remat, layout). One XLA compile each (~1-4 s here), so not the full
# 3 x 3 x 2 x 2 product: Qwen3 runs a pairwise cover (every two values of attention, remat
# and layout meet in some case), the other families each attention once with both remat
# settings and both layouts.
CASES = [
    ("qwen3", "xla", "none", "padded"),
    ("qwen3", "xla", "full", "packed"),
    ("qwen3", "dot_product", "none", "packed"),
    ("qwen3", "dot_product", "full", "padded"),
    ("qwen3", "blockwise", "none", "packed"),
    ("qwen3", "blockwise", "full", "padded"),
    ("qwen2", "xla", "none", "packed"),
    ("qwen2", "dot_product", "full", "padded"),
    ("qwen2", "blockwise", "full", "packed"),
    ("llama", "xla", "full", "packed"),
    ("llama", "dot_product", "none", "padded"),
    ("llama", "blockwise", "none", "packed"),
]
# Log-probs chunk by chunk (learner_jax/model/logprobs.py, chunks of 7: a padded last chunk) in a
# tied-head and an untied-head case; the others take the full [B, T, V] logits.
CHUNKED = {("qwen3", "blockwise", "none", "packed"), ("llama", "dot_product", "none", "padded")}
BLOCK = 5  # 'blockwise' tiles T = 12 into 3 blocks (padded to 15) and L = 16 into 4 (20)
LENGTHS = (12, 5, 9, 3, 7, 10)  # tokens per sequence: n inputs, n - 1 targets (40 in all)
ROW_LEN = 16  # packed rows: first-fit gives [12, 3], [10, 5], [9, 7] (two segments each)
REL_TOL = 1e-4  # per leaf ||g - g_ref|| / ||g_ref|| (module docstring)


def _sequences(vocab: int, seed: int = 0):
    """Right-padded rows [B, T+1] (token 0 = padding) and coefficients [B, T]."""
    rng = np.random.default_rng(seed)
    t = max(LENGTHS)
    tokens = np.zeros((len(LENGTHS), t + 1), np.int32)
    for i, n in enumerate(LENGTHS):
        tokens[i, :n] = rng.integers(3, vocab, n)
    batch = train_step.make_batch(tokens, np.ones_like(tokens, np.float32))
    coef = rng.uniform(-1.0, 2.0, (len(LENGTHS), t)) * batch.loss_mask
    return batch, coef.astype(np.float32)


def _flat(tree) -> dict[tuple[str, ...], np.ndarray]:
    return {
        tuple(k.key for k in path): np.asarray(x, np.float64)
        for path, x in jax.tree_util.tree_leaves_with_path(tree)
    }


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """family -> (cfg, Flax params fp32, batch, coef, torch objective, Flax-named grads fp64).

    One HF dir and one torch backward per family for the whole module."""
    out = {}
    for seed, family in enumerate(FAMILIES):
        cfg = tiny_model.tiny_config(family)
        path = str(tmp_path_factory.mktemp(family))
        tiny_model.make_tiny_model(path, cfg, seed)
        weights = tiny_model.random_hf_weights(cfg, seed, std=0.2)
        save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
        batch, coef = _sequences(cfg.vocab_size, seed)

        hf = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float64, attn_implementation="eager"
        )
        # Each sequence on its own row from index 0; right padding is never attended to.
        logits = hf(
            input_ids=torch.tensor(batch.tokens, dtype=torch.long),
            attention_mask=torch.tensor(batch.segment_ids, dtype=torch.long),
            position_ids=torch.tensor(batch.positions, dtype=torch.long),
        ).logits  # [B, T, V] float64
        logp = torch.log_softmax(logits, -1)
        logp = logp.gather(-1, torch.tensor(batch.targets, dtype=torch.long)[..., None])[..., 0]
        objective = (logp * torch.tensor(coef, dtype=torch.float64)).sum()
        objective.backward()
        hf_grads = {n: p.grad.numpy() for n, p in hf.named_parameters()}
        if cfg.tie_word_embeddings:  # transformers lists the tied head once, as the embedding
            hf_grads.pop("lm_head.weight", None)
        grads = _flat(layouts.hf_to_flax(cfg, hf_grads))
        assert all(np.linalg.norm(g) > 0 for g in grads.values())  # every leaf is exercised
        params = layouts.hf_to_flax(cfg, weights)
        out[family] = (cfg, params, batch, coef, objective.item(), grads)
    return out


def _jax_grad_fn(cfg, opts: model.ModelOptions, packed: bool):
    """jit(value_and_grad) of the objective on the padded or the packed layout."""

    def objective(params, batch, coef):
        if packed:  # the learner's path: packed rows in, gathered back to [B, T]
            p = batch.pack
            logp = model.forward_logprobs(
                params, cfg, p.tokens, p.positions, p.segment_ids, p.targets, options=opts
            )
            logp = packing.unpack(logp, p, batch.tokens.shape[1])
        else:
            logp = model.forward_logprobs(
                params,
                cfg,
                batch.tokens,
                batch.positions,
                batch.segment_ids,
                batch.targets,
                options=opts,
            )
        return (logp * coef).sum()

    return jax.jit(jax.value_and_grad(objective))


def _rel_errors(grads, ref) -> dict[str, float]:
    grads = _flat(grads)
    assert grads.keys() == ref.keys()
    return {
        "/".join(k): float(np.linalg.norm(grads[k] - ref[k]) / np.linalg.norm(ref[k])) for k in ref
    }


def _check(references, family, attention, remat, packed):
    cfg, params, batch, coef, ref_value, ref_grads = references[family]
    case = (family, attention, remat, "packed" if packed else "padded")
    opts = model.ModelOptions(
        attention=attention,
        remat=remat,
        attention_block=BLOCK,
        logprob_chunk=7 if case in CHUNKED else 0,
    )
    if packed:
        batch = packing.pack_batch(batch, micro_batches=1, row_len=ROW_LEN)
        assert batch.pack.tokens.shape == (3, ROW_LEN)  # really packed: two segments a row
    value, grads = _jax_grad_fn(cfg, opts, packed)(params, batch, jnp.asarray(coef))
    value = float(value)
    assert abs(value - ref_value) <= REL_TOL * abs(ref_value), f"objective {value} vs {ref_value}"
    return _rel_errors(jax.device_get(grads), ref_grads)


@pytest.mark.parametrize("family,attention,remat,layout", CASES, ids=["-".join(c) for c in CASES])
def test_param_gradients_match_torch_autograd(references, family, attention, remat, layout):
    errs = _check(references, family, attention, remat, layout == "packed")
    bad = {k: v for k, v in errs.items() if v > REL_TOL}
    worst = sorted(errs.items(), key=lambda kv: -kv[1])[:4]
    assert not bad, (
        f"{len(bad)}/{len(errs)} leaves off by more than {REL_TOL} (relative L2); worst: "
        + ", ".join(f"{k} {v:.3g}" for k, v in worst)
    )
