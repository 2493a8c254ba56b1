"""Flax <-> HF weight layout tables, one per model family (numpy only).

Weights cross the JAX/torch boundary in the HF convention: HF names, `[out, in]` linear
layout, one tensor per HF name (q/k/v and gate/up stay separate; vLLM fuses them in its
own `load_weights`). Each table row maps one Flax parameter path to one HF name with an
invertible transform; `tests/bridge/model/layouts_test.py` checks every parameter of every
family is covered exactly once in both directions.

The Flax parameter tree (`learner_jax/model.py`), with its logical axes:
  embed/embedding                      [V, D]     (vocab, embed)
  layers_{i}/attn/q_proj/kernel        [D, N, H]  (embed, heads, kv)
  layers_{i}/attn/{k,v}_proj/kernel    [D, K, H]  (embed, kv_heads, kv)
  layers_{i}/attn/q_proj/bias          [N, H]     (heads, kv)        attention_bias only
  layers_{i}/attn/{k,v}_proj/bias      [K, H]     (kv_heads, kv)     attention_bias only
  layers_{i}/attn/o_proj/kernel        [N, H, D]  (heads, kv, embed)
  layers_{i}/attn/{q,k}_norm/scale     [H]        (kv)               qk_norm only
  layers_{i}/mlp/{gate,up}_proj/kernel [D, F]     (embed, mlp)
  layers_{i}/mlp/down_proj/kernel      [F, D]     (mlp, embed)
  layers_{i}/input_norm/scale          [D]        (embed)
  layers_{i}/post_attn_norm/scale      [D]        (embed)
  final_norm/scale                     [D]        (embed)
  lm_head/kernel                       [D, V]     (embed, vocab)     untied only
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from bridge.model.config import ModelConfig

FlaxPath = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Transform:
    """An invertible reshaping between a Flax array and its HF tensor."""

    name: str
    to_hf: Callable[[np.ndarray], np.ndarray]
    from_hf: Callable[[np.ndarray], np.ndarray]


IDENTITY = Transform("identity", lambda x: x, lambda x: x)
# Flax [in, out] <-> HF [out, in].
LINEAR = Transform("linear", lambda x: x.T, lambda x: x.T)


def heads_in(heads: int, head_dim: int) -> Transform:
    """q/k/v kernel: Flax [D, N, H] <-> HF [N*H, D]."""
    return Transform(
        "heads_in",
        lambda x: x.reshape(x.shape[0], heads * head_dim).T,
        lambda x: x.T.reshape(x.shape[1], heads, head_dim),
    )


def heads_bias(heads: int, head_dim: int) -> Transform:
    """q/k/v bias: Flax [N, H] <-> HF [N*H]."""
    return Transform(
        "heads_bias", lambda x: x.reshape(heads * head_dim), lambda x: x.reshape(heads, head_dim)
    )


def heads_out(heads: int, head_dim: int) -> Transform:
    """o_proj kernel: Flax [N, H, D] <-> HF [D, N*H]."""
    return Transform(
        "heads_out",
        lambda x: x.reshape(heads * head_dim, x.shape[-1]).T,
        lambda x: x.T.reshape(heads, head_dim, x.shape[0]),
    )


@dataclasses.dataclass(frozen=True)
class Row:
    flax_path: FlaxPath
    hf_name: str
    transform: Transform


# Family name -> function building its table from a ModelConfig.
FAMILIES: dict[str, Callable[[ModelConfig], list[Row]]] = {}


def register_family(name: str):
    def deco(fn):
        FAMILIES[name] = fn
        return fn

    return deco


def _decoder_rows(cfg: ModelConfig) -> list[Row]:
    """Rows shared by every supported family; the family functions add their extras."""
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    rows = [Row(("embed", "embedding"), "model.embed_tokens.weight", IDENTITY)]
    for i in range(cfg.num_layers):
        f, hf = f"layers_{i}", f"model.layers.{i}"
        rows += [
            Row((f, "attn", "q_proj", "kernel"), f"{hf}.self_attn.q_proj.weight", heads_in(n, h)),
            Row((f, "attn", "k_proj", "kernel"), f"{hf}.self_attn.k_proj.weight", heads_in(k, h)),
            Row((f, "attn", "v_proj", "kernel"), f"{hf}.self_attn.v_proj.weight", heads_in(k, h)),
            Row((f, "attn", "o_proj", "kernel"), f"{hf}.self_attn.o_proj.weight", heads_out(n, h)),
            Row((f, "mlp", "gate_proj", "kernel"), f"{hf}.mlp.gate_proj.weight", LINEAR),
            Row((f, "mlp", "up_proj", "kernel"), f"{hf}.mlp.up_proj.weight", LINEAR),
            Row((f, "mlp", "down_proj", "kernel"), f"{hf}.mlp.down_proj.weight", LINEAR),
            Row((f, "input_norm", "scale"), f"{hf}.input_layernorm.weight", IDENTITY),
            Row((f, "post_attn_norm", "scale"), f"{hf}.post_attention_layernorm.weight", IDENTITY),
        ]
        if cfg.attention_bias:
            for proj, heads in (("q_proj", n), ("k_proj", k), ("v_proj", k)):
                rows.append(
                    Row(
                        (f, "attn", proj, "bias"),
                        f"{hf}.self_attn.{proj}.bias",
                        heads_bias(heads, h),
                    )
                )
        if cfg.qk_norm:
            for norm in ("q_norm", "k_norm"):
                rows.append(
                    Row((f, "attn", norm, "scale"), f"{hf}.self_attn.{norm}.weight", IDENTITY)
                )
    rows.append(Row(("final_norm", "scale"), "model.norm.weight", IDENTITY))
    if not cfg.tie_word_embeddings:
        rows.append(Row(("lm_head", "kernel"), "lm_head.weight", LINEAR))
    return rows


@register_family("qwen3")
def qwen3_rows(cfg: ModelConfig) -> list[Row]:
    assert cfg.qk_norm and not cfg.attention_bias, "Qwen3: q/k norm, no qkv bias"
    return _decoder_rows(cfg)


@register_family("qwen2")
def qwen2_rows(cfg: ModelConfig) -> list[Row]:
    assert cfg.attention_bias and not cfg.qk_norm, "Qwen2: qkv bias, no q/k norm"
    return _decoder_rows(cfg)


@register_family("llama")
def llama_rows(cfg: ModelConfig) -> list[Row]:
    assert not cfg.qk_norm, "Llama has no q/k norm"
    return _decoder_rows(cfg)


def table(cfg: ModelConfig) -> list[Row]:
    if cfg.family not in FAMILIES:
        raise ValueError(f"no layout table for family {cfg.family!r}; known: {sorted(FAMILIES)}")
    return FAMILIES[cfg.family](cfg)


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape, from the architecture alone (used to validate published versions)."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    shapes = {}
    for row in table(cfg):
        name = row.hf_name
        if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
            shapes[name] = (v, d)
        elif "q_proj" in name:
            shapes[name] = (n * h, d) if name.endswith("weight") else (n * h,)
        elif "k_proj" in name or "v_proj" in name:
            shapes[name] = (k * h, d) if name.endswith("weight") else (k * h,)
        elif "o_proj" in name:
            shapes[name] = (d, n * h)
        elif "gate_proj" in name or "up_proj" in name:
            shapes[name] = (f, d)
        elif "down_proj" in name:
            shapes[name] = (d, f)
        elif "q_norm" in name or "k_norm" in name:
            shapes[name] = (h,)
        else:
            shapes[name] = (d,)
    return shapes


def _get(tree: Mapping, path: FlaxPath):
    for key in path:
        tree = tree[key]
    return tree


def flax_to_hf(cfg: ModelConfig, params: Mapping) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, numpy array in HF layout) for a nested Flax param dict of numpy arrays."""
    for row in table(cfg):
        yield (
            row.hf_name,
            np.ascontiguousarray(row.transform.to_hf(np.asarray(_get(params, row.flax_path)))),
        )


def hf_to_flax(cfg: ModelConfig, tensors: Mapping[str, np.ndarray]) -> dict:
    """Nested Flax param dict from a mapping HF name -> numpy array (all of them, no extras)."""
    rows = table(cfg)
    expected = {r.hf_name for r in rows}
    missing, extra = expected - set(tensors), set(tensors) - expected
    if missing or extra:
        raise ValueError(
            f"HF tensors do not match {cfg.family}: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(extra)[:5]}"
        )
    params: dict = {}
    for row in rows:
        node = params
        for key in row.flax_path[:-1]:
            node = node.setdefault(key, {})
        node[row.flax_path[-1]] = row.transform.from_hf(np.asarray(tensors[row.hf_name]))
    return params
