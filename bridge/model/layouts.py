"""Flax <-> HF weight layout tables, one per model family (numpy only).

Weights cross the JAX/torch boundary in the HF convention: HF names, `[out, in]` linear
layout, one tensor per HF name (q/k/v and gate/up stay separate; vLLM fuses them in its
own `load_weights`). Each table row maps one Flax parameter path and shape to one HF name
with an invertible `Transform`, which is the one place that knows the HF shape, the numpy
conversion both ways and where a shard of the Flax array lands in the HF tensor (the
learner publishes shard by shard with it); nothing else guesses layouts from names.
`tests/bridge/model/layouts_test.py` checks every parameter of every family is covered
exactly once in both directions, against the state dict transformers builds.

The Flax parameter tree (`learner_jax/model/model.py`), with its logical axes:
  embed/embedding                      [V, D]     (vocab, embed)
  layers_{i}/attn/q_proj/kernel        [D, N, H]  (embed, heads, kv)
  layers_{i}/attn/{k,v}_proj/kernel    [D, K, H]  (embed, kv_heads, kv)
  layers_{i}/attn/q_proj/bias          [N, H]     (heads, kv)        attention_bias only
  layers_{i}/attn/{k,v}_proj/bias      [K, H]     (kv_heads, kv)     attention_bias only
  layers_{i}/attn/o_proj/kernel        [N, H, D]  (heads, kv, embed)
  layers_{i}/attn/{q,k}_norm/scale     [H]        (kv)               qk_norm only
  layers_{i}/mlp/{gate,up}_proj/kernel [D, F]     (embed, mlp)
  layers_{i}/mlp/down_proj/kernel      [F, D]     (mlp, embed)
  layers_{i}/mlp/gate/kernel           [D, E]     (embed, None)      MoE layers: the router
  layers_{i}/mlp/experts/{gate,up}_proj [E, D, I] (expert, embed, mlp) MoE layers
  layers_{i}/mlp/experts/down_proj     [E, I, D]  (expert, mlp, embed) MoE layers
  layers_{i}/input_norm/scale          [D]        (embed)
  layers_{i}/post_attn_norm/scale      [D]        (embed)
  final_norm/scale                     [D]        (embed)
  lm_head/kernel                       [D, V]     (embed, vocab)     untied only

A MoE layer (`ModelConfig.is_moe_layer`) has the router and the experts in place of the
dense mlp rows. The Flax side stacks the experts on a leading `expert` axis (so they can be
split over a mesh axis and multiplied with one grouped matmul); the HF side keeps the
checkpoint convention, one `[out, in]` tensor per expert and projection
(`mlp.experts.{e}.{gate,up,down}_proj.weight`), which is what vLLM loads and what
transformers >= 5 fuses itself when loading. Each such row's transform carries its expert
index (`Transform.expert`): that one slice of the stacked leaf is its HF tensor, and a
leaf is rebuilt from its E rows with `leaf_from_hf`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping

import numpy as np

from bridge.model.config import ModelConfig

FlaxPath = tuple[str, ...]
Index = tuple[slice, ...]
# HF tensors some exporters write that are buffers, not parameters (recomputed from the
# config): a checkpoint may carry them, the tables never list them.
BUFFER_SUFFIXES = ("rotary_emb.inv_freq",)


def _bounds(s: slice, n: int) -> tuple[int, int]:
    lo, hi, _ = s.indices(n)
    return lo, hi


@dataclasses.dataclass(frozen=True)
class Transform:
    """Flax array -> HF tensor as two steps: merge the (heads, head_dim) axes at
    `heads_axis` into one N*H axis (when set), then reverse the axes (when `transpose`).

    Everything else is derived from those two steps, so the numpy conversion, the HF shape
    and the shard index mapping cannot disagree. `to_hf` reads the sizes off its input, so
    it converts a shard's block as well as a whole array; `from_hf` needs `heads` and
    `head_dim` to split the merged axis again.
    """

    name: str
    transpose: bool = False
    heads_axis: int | None = None
    heads: int = 0
    head_dim: int = 0
    # The HF tensor is slice `expert` of the Flax leaf's leading (expert) axis; the other
    # two steps then apply to that slice.
    expert: int | None = None

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        """The whole Flax leaf, or the block `shard_pieces` cut (for an expert row: its 2-D
        slice, the expert axis already indexed away) -> the HF tensor (or its piece)."""
        if self.expert is not None and x.ndim == 3:
            x = x[self.expert]
        if self.heads_axis is not None:
            a = self.heads_axis
            x = x.reshape(*x.shape[:a], -1, *x.shape[a + 2 :])
        return x.T if self.transpose else x

    def from_hf(self, x: np.ndarray) -> np.ndarray:
        """HF tensor -> Flax layout (an expert row: its slice of the leaf, see leaf_from_hf)."""
        x = x.T if self.transpose else x
        if self.heads_axis is not None:
            a = self.heads_axis
            x = x.reshape(*x.shape[:a], self.heads, self.head_dim, *x.shape[a + 1 :])
        return x

    def hf_shape(self, flax_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = tuple(flax_shape)
        if self.expert is not None:
            shape = shape[1:]
        if self.heads_axis is not None:
            a = self.heads_axis
            shape = (*shape[:a], shape[a] * shape[a + 1], *shape[a + 2 :])
        return shape[::-1] if self.transpose else shape

    def shard_pieces(self, index: Index, flax_shape: tuple[int, ...]) -> list[tuple[Index, Index]]:
        """Where the Flax block at `index` lands in HF: [(HF index, block-local Flax index)].

        Convert a piece with `to_hf(block[local])`. A block whose head_dim range is partial
        and spans several heads is not a rectangle on the merged N*H axis, so it is cut
        into one piece per head; otherwise there is one piece, the whole block.
        """
        if self.expert is not None:  # this expert's slice of the block, if it holds it
            e0, e1 = _bounds(index[0], flax_shape[0])
            if not e0 <= self.expert < e1:
                return []
            inner = dataclasses.replace(self, expert=None)
            return [
                (hf, (self.expert - e0, *local))
                for hf, local in inner.shard_pieces(index[1:], flax_shape[1:])
            ]
        spans = [_bounds(s, n) for s, n in zip(index, flax_shape, strict=True)]
        hf, whole = [slice(*b) for b in spans], tuple(slice(None) for _ in spans)
        if self.heads_axis is None:
            pieces = [(hf, whole)]
        else:
            a, hd = self.heads_axis, flax_shape[self.heads_axis + 1]
            (n0, n1), (h0, h1) = spans[a], spans[a + 1]
            if (h0, h1) == (0, hd):
                cuts = [(slice(n0 * hd, n1 * hd), whole)]
            else:
                cuts = [
                    (slice(i * hd + h0, i * hd + h1), (*whole[:a], slice(i - n0, i - n0 + 1)))
                    for i in range(n0, n1)
                ]
            pieces = [([*hf[:a], merged, *hf[a + 2 :]], local) for merged, local in cuts]
        return [(tuple(hf[::-1] if self.transpose else hf), local) for hf, local in pieces]


IDENTITY = Transform("identity")
# Flax [in, out] <-> HF [out, in].
LINEAR = Transform("linear", transpose=True)


def expert_linear(expert: int) -> Transform:
    """One expert's kernel: Flax [E, in, out][expert] <-> HF [out, in]."""
    return Transform("expert_linear", transpose=True, expert=expert)


def heads_in(heads: int, head_dim: int) -> Transform:
    """q/k/v kernel: Flax [D, N, H] <-> HF [N*H, D]."""
    return Transform("heads_in", transpose=True, heads_axis=1, heads=heads, head_dim=head_dim)


def heads_bias(heads: int, head_dim: int) -> Transform:
    """q/k/v bias: Flax [N, H] <-> HF [N*H]."""
    return Transform("heads_bias", heads_axis=0, heads=heads, head_dim=head_dim)


def heads_out(heads: int, head_dim: int) -> Transform:
    """o_proj kernel: Flax [N, H, D] <-> HF [D, N*H]."""
    return Transform("heads_out", transpose=True, heads_axis=0, heads=heads, head_dim=head_dim)


@dataclasses.dataclass(frozen=True)
class Row:
    """One parameter: its Flax path and shape, its HF name, and the transform between them.

    `norm` marks an RMSNorm scale (initialised near 1, not near 0).
    """

    flax_path: FlaxPath
    hf_name: str
    transform: Transform
    flax_shape: tuple[int, ...]
    norm: bool = False

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return self.transform.hf_shape(self.flax_shape)


# Family name -> function building its table from a ModelConfig.
FAMILIES: dict[str, Callable[[ModelConfig], list[Row]]] = {}


def register_family(name: str):
    def deco(fn):
        FAMILIES[name] = fn
        return fn

    return deco


def _layer_rows(cfg: ModelConfig, i: int) -> list[Row]:
    d, f = cfg.hidden_size, cfg.intermediate_size
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    fl, hf = f"layers_{i}", f"model.layers.{i}"

    def attn(proj: str, leaf: str, transform: Transform, shape: tuple[int, ...]) -> Row:
        hf_leaf = "bias" if leaf == "bias" else "weight"
        path, name = (fl, "attn", proj, leaf), f"{hf}.self_attn.{proj}.{hf_leaf}"
        return Row(path, name, transform, shape, norm=leaf == "scale")

    def mlp(proj: str, shape: tuple[int, ...]) -> Row:
        return Row((fl, "mlp", proj, "kernel"), f"{hf}.mlp.{proj}.weight", LINEAR, shape)

    def norm(flax_name: str, hf_name: str) -> Row:
        return Row((fl, flax_name, "scale"), f"{hf}.{hf_name}.weight", IDENTITY, (d,), norm=True)

    if cfg.is_moe_layer(i):
        mlp_rows = _moe_rows(cfg, i)
    else:
        mlp_rows = [mlp("gate_proj", (d, f)), mlp("up_proj", (d, f)), mlp("down_proj", (f, d))]
    rows = [
        attn("q_proj", "kernel", heads_in(n, h), (d, n, h)),
        attn("k_proj", "kernel", heads_in(k, h), (d, k, h)),
        attn("v_proj", "kernel", heads_in(k, h), (d, k, h)),
        attn("o_proj", "kernel", heads_out(n, h), (n, h, d)),
        *mlp_rows,
        norm("input_norm", "input_layernorm"),
        norm("post_attn_norm", "post_attention_layernorm"),
    ]
    if cfg.attention_bias:
        for proj, heads in (("q_proj", n), ("k_proj", k), ("v_proj", k)):
            rows.append(attn(proj, "bias", heads_bias(heads, h), (heads, h)))
    if cfg.qk_norm:
        rows += [attn(qk, "scale", IDENTITY, (h,)) for qk in ("q_norm", "k_norm")]
    return rows


def _moe_rows(cfg: ModelConfig, i: int) -> list[Row]:
    """Router + every expert's three projections of sparse layer i (expert-major)."""
    d, e, m = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    fl, hf = f"layers_{i}", f"model.layers.{i}.mlp"
    rows = [Row((fl, "mlp", "gate", "kernel"), f"{hf}.gate.weight", LINEAR, (d, e))]
    shapes = {"gate_proj": (e, d, m), "up_proj": (e, d, m), "down_proj": (e, m, d)}
    for x in range(e):
        for proj, shape in shapes.items():
            path, name = (fl, "mlp", "experts", proj), f"{hf}.experts.{x}.{proj}.weight"
            rows.append(Row(path, name, expert_linear(x), shape))
    return rows


def _decoder_rows(cfg: ModelConfig) -> list[Row]:
    """Rows shared by every supported family; the family functions add their extras."""
    d, v = cfg.hidden_size, cfg.vocab_size
    rows = [Row(("embed", "embedding"), "model.embed_tokens.weight", IDENTITY, (v, d))]
    for i in range(cfg.num_layers):
        rows += _layer_rows(cfg, i)
    rows.append(Row(("final_norm", "scale"), "model.norm.weight", IDENTITY, (d,), norm=True))
    if not cfg.tie_word_embeddings:
        rows.append(Row(("lm_head", "kernel"), "lm_head.weight", LINEAR, (d, v)))
    return rows


@register_family("qwen3")
def qwen3_rows(cfg: ModelConfig) -> list[Row]:
    assert cfg.qk_norm and not cfg.attention_bias, "Qwen3: q/k norm, no qkv bias"
    return _decoder_rows(cfg)


@register_family("qwen3_moe")
def qwen3_moe_rows(cfg: ModelConfig) -> list[Row]:
    assert cfg.qk_norm and not cfg.attention_bias, "Qwen3-MoE: q/k norm, no qkv bias"
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
    return {row.hf_name: row.hf_shape for row in table(cfg)}


def is_buffer(hf_name: str) -> bool:
    """An HF tensor that is not a parameter (see BUFFER_SUFFIXES)."""
    return hf_name.endswith(BUFFER_SUFFIXES)


def get_leaf(tree: Mapping, path: FlaxPath):
    for key in path:
        tree = tree[key]
    return tree


def set_leaf(tree: dict, path: FlaxPath, value) -> None:
    """tree[path[0]]...[path[-1]] = value, creating the inner dicts."""
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def leaves(rows: list[Row]) -> dict[FlaxPath, list[Row]]:
    """Flax leaf -> the rows that make it up: one, or a stacked leaf's E expert rows in
    expert order."""
    out: dict[FlaxPath, list[Row]] = {}
    for row in rows:
        out.setdefault(row.flax_path, []).append(row)
    for group in out.values():
        group.sort(key=lambda r: -1 if r.transform.expert is None else r.transform.expert)
    return out


def leaf_from_hf(rows: list[Row], tensor: Callable[[str], np.ndarray]) -> np.ndarray:
    """One Flax leaf from its rows (`leaves`), reading each HF tensor with `tensor(name)`."""
    if rows[0].transform.expert is None:
        return rows[0].transform.from_hf(np.asarray(tensor(rows[0].hf_name)))
    if [r.transform.expert for r in rows] != list(range(rows[0].flax_shape[0])):
        raise ValueError(f"{'/'.join(rows[0].flax_path)}: expert rows are not 0..E-1")
    return np.stack([r.transform.from_hf(np.asarray(tensor(r.hf_name))) for r in rows])


def flax_to_hf(cfg: ModelConfig, params: Mapping) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF name, numpy array in HF layout) for a nested Flax param dict of numpy arrays."""
    for row in table(cfg):
        yield (
            row.hf_name,
            np.ascontiguousarray(row.transform.to_hf(np.asarray(get_leaf(params, row.flax_path)))),
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
    for path, group in leaves(rows).items():
        set_leaf(params, path, leaf_from_hf(group, tensors.__getitem__))
    return params
