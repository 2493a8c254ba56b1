"""Splash attention: the Pallas TPU flash kernel behind `attention.attend`'s interface.

`jax.experimental.pallas.ops.tpu.splash_attention` computes one example's attention,
q [N, T, H] and k, v [K, T, H], under a static mask (causal here) that it turns once per
shape into block-sparsity tables, so key blocks wholly above the diagonal are never
loaded, and-ed with `SegmentIds` (query and key ids equal). Grouped-query attention is
native to its multi-head kernel: query head n reads kv head n // G, the grouping
`xla_attention` uses, so k/v are not repeated. We vmap it over the batch.

What this adapter adds around the kernel:
- Scale: the kernel computes q.k unscaled, so q is multiplied by H^-0.5 first.
- Padding (segment 0): the kernel's segment test is equality only, so a padding query
  attends to earlier-or-equal padding keys of its row, never to real tokens (ids != 0),
  and real queries never see padding keys. Every row keeps at least its diagonal: the
  kernel needs that (its fill is a finite -0.7 * float32 max, and by its source a fully
  masked row would average the values instead of failing). Padding rows' outputs
  therefore differ from the uniform row of "xla"; they are finite and unread, as in
  "blockwise".
- Shapes: Mosaic tiles the sequence in blocks that are multiples of 128 lanes, so T is
  padded up to a multiple of the block with segment 0 (sliced off after), and H up to a
  multiple of 128 with zeros (zero columns add nothing to q.k; v's zero columns give
  output columns that are sliced off).
- Meshes: a Mosaic kernel cannot be partitioned by XLA ("Mosaic kernels cannot be
  automatically partitioned. Please wrap the call in a shard_map."), so under a
  multi-device mesh (`jax.set_mesh`, as `sharding.use_mesh` does) the call is wrapped in
  `shard_map` over the mesh axes of the logical "batch" and "act_heads" rules. Heads are
  split only where both N and K divide by those axes' size (the grouping n // G then
  stays within a shard); otherwise heads are whole on every device.
- Off TPU the kernel runs in Pallas interpret mode (`interpret=True`: the pallas_call is
  lowered to a jitted loop over its grid in plain HLO). That is how the tests check it on
  CPU; it is slow and meant for tests only. "auto" picks splash on TPU only.

Not run on a TPU here (none lent): the Mosaic compile, speed, and the precision of its
float32 matmuls on the MXU are unmeasured; CPU interpret mode checks the arithmetic.

Einsum letters: B batch, T time, N heads, K kv heads, H head dim.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu import splash_attention as sa
from jax.sharding import PartitionSpec

LANES = 128  # Mosaic's lane width: block and head-dim multiple


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


@functools.lru_cache(maxsize=32)
def _kernel(t: int, n: int, block: int, interpret: bool):
    """The causal multi-head kernel for padded length t (its mask tables are numpy work)."""
    causal = sa.MultiHeadMask([sa.CausalMask((t, t))] * n)
    sizes = sa.BlockSizes(
        block_q=block,
        block_kv=block,
        block_kv_compute=block,
        block_q_dkv=block,
        block_kv_dkv=block,
        block_kv_dkv_compute=block,
        block_q_dq=block,
        block_kv_dq=block,
    )
    # Its mask tables become constants, not values of whichever trace first asked: cached.
    with jax.ensure_compile_time_eval():
        return sa.make_splash_mha_single_device(causal, block_sizes=sizes, interpret=interpret)


def splash_attention(q, k, v, segment_ids, block_size: int = 512, interpret: bool | None = None):
    """Masked causal attention through the splash kernel, [B, T, N, H] in q's dtype."""
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    fn = functools.partial(_local, block_size=block_size, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return fn(q, k, v, segment_ids)
    batch, heads = _mesh_axes(mesh, q.shape[0], q.shape[2], k.shape[2])
    qkv = PartitionSpec(batch, None, heads, None)
    return jax.shard_map(
        fn,
        mesh=mesh,
        in_specs=(qkv, qkv, qkv, PartitionSpec(batch, None)),
        out_specs=qkv,
        check_vma=False,
    )(q, k, v, segment_ids)


def _mesh_axes(mesh, b: int, n: int, kh: int):
    """Mesh axes for the batch and head dims: the logical rules' axes where they divide."""

    def axes(logical, *sizes):
        spec = nn.logical_to_mesh_axes((logical,))
        names = () if spec is None or spec[0] is None else spec[0]
        names = (names,) if isinstance(names, str) else tuple(names)
        names = tuple(a for a in names if a in mesh.axis_names)
        ways = int(np.prod([mesh.shape[a] for a in names], initial=1))
        return names if names and all(s % ways == 0 for s in sizes) else None

    return axes("batch", b), axes("act_heads", n, kh)


def _local(q, k, v, segment_ids, block_size: int, interpret: bool):
    """One device's share: pad, vmap the kernel over the batch, unpad."""
    b, t, n, h = q.shape
    block = max(LANES, _round_up(min(block_size, t), LANES))
    tp, hp = _round_up(t, block), _round_up(h, LANES)
    q = q * jnp.asarray(h**-0.5, q.dtype)
    widths = ((0, 0), (0, tp - t), (0, 0), (0, hp - h))
    # [B, T, N, H] -> [B, N, Tp, Hp]: the kernel's heads-major layout, padded
    q, k, v = (jnp.swapaxes(jnp.pad(x, widths), 1, 2) for x in (q, k, v))
    seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, tp - t)))  # [B, Tp]
    kernel = _kernel(tp, n, block, interpret)
    out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=sa.SegmentIds(s, s)))(
        q, k, v, seg
    )  # [B, N, Tp, Hp]
    return jnp.swapaxes(out, 1, 2)[:, :t, :, :h]  # [B, T, N, H]
