"""Sequence packing: the model runs on fixed-budget rows holding several sequences each.

    batch = pack_batch(batch, micro_batches=k, shards=data*fsdp, row_len=L)

A learner `Batch` has one sequence per row, right-padded to the longest possible one, so
a step's forward/backward memory and FLOPs follow rows x max length. Packing places the
sequences (their real input tokens) first-fit-decreasing into rows of `row_len` tokens
with segment ids 1, 2, ... per row (0 = padding) and positions restarting at each
segment; attention (attention.py) never crosses a segment, so every sequence sees
exactly the context it had alone.

Only the forward pass moves: the step computes per-token log-probs (and entropy,
accuracy) in the packed layout, then gathers them back into the unpacked [B, T] layout
(`unpack`), where every loss, mask and metric runs unchanged. So a batch's per-token
masks (loss_mask, an environment's mask, behaviour log-probs, anything [B, T]) are
carried as they are, and packed == unpacked up to float rounding
(tests/learner_jax/training/packing_test.py).

Shapes: micro-batch i (the strided rows i, i+k, ... of train_step._split) packs its own
sequences into its own rows, so a sequence and its packed row always land in the same
micro-batch. Rows per micro-batch are what first-fit needs for the fullest micro-batch,
rounded up to a multiple of `shards` (rows are sharded over data x fsdp); a new row count
is a new shape, so jit compiles at most rows_per_micro / shards variants. The gather
back to [B, T] may cross devices when a sequence's packed row is on another shard (a
[B, T] float exchange, no vocab axis): cheap next to the forward it saves.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Packing:
    """The packed model input of a batch and where each sequence sits in it."""

    tokens: jax.Array  # int32 [R, L]
    positions: jax.Array  # int32 [R, L] restart at 0 in every segment
    segment_ids: jax.Array  # int32 [R, L] 1.. per sequence in the row, 0 = padding
    targets: jax.Array  # int32 [R, L]
    row: jax.Array  # int32 [B] the packed row (within its micro-batch) of sequence b
    start: jax.Array  # int32 [B] its first token's index in that row
    length: jax.Array  # int32 [B] its real input tokens (0 = an empty row)


def first_fit(lengths, row_len: int) -> list[list[int]]:
    """Indices grouped into rows of at most `row_len` tokens, longest first (FFD)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = int(lengths[i])
        if n > row_len:
            raise ValueError(f"a sequence of {n} tokens does not fit a packed row of {row_len}")
        j = next((j for j, r in enumerate(room) if r >= n), None)
        if j is None:
            rows.append([])
            room.append(row_len)
            j = len(rows) - 1
        rows[j].append(i)
        room[j] -= n
    return rows


def pack_batch(batch, micro_batches: int, shards: int = 1, row_len: int | None = None):
    """A copy of the numpy `batch` (train_step.Batch) with its `pack` set (see above)."""
    tokens = np.asarray(batch.tokens)
    seg = np.asarray(batch.segment_ids)
    b, t = tokens.shape
    k, row_len = micro_batches, row_len or t
    if b % k:
        raise ValueError(f"batch of {b} rows does not split into {k} micro-batches")
    lengths = (seg > 0).sum(axis=1)
    # Real tokens must be a prefix of the row (right padding), as make_batch builds them.
    if np.any((seg > 0) != (np.arange(t)[None, :] < lengths[:, None])):
        raise ValueError("packing needs right-padded rows (real tokens first)")
    plans = [first_fit(lengths[i::k], row_len) for i in range(k)]
    per_micro = max(1, max(len(p) for p in plans))
    per_micro = -(-per_micro // shards) * shards
    r = per_micro * k
    out = {n: np.zeros((r, row_len), np.int32) for n in ("tokens", "positions", "seg", "targets")}
    row, start = np.zeros(b, np.int32), np.zeros(b, np.int32)
    src = {
        "tokens": tokens,
        "positions": np.asarray(batch.positions),
        "targets": np.asarray(batch.targets),
    }
    for i, plan in enumerate(plans):
        for local, members in enumerate(plan):
            g, offset = local * k + i, 0  # global row: the strided split gives it back
            for s_id, m in enumerate(members, start=1):
                seq = i + m * k  # m indexes micro-batch i's sequences i, i+k, ...
                n = int(lengths[seq])
                for name, a in src.items():
                    out[name][g, offset : offset + n] = a[seq, :n]
                out["seg"][g, offset : offset + n] = s_id
                row[seq], start[seq] = local, offset
                offset += n
    pack = Packing(
        tokens=out["tokens"],
        positions=out["positions"],
        segment_ids=out["seg"],
        targets=out["targets"],
        row=row,
        start=start,
        length=lengths.astype(np.int32),
    )
    return dataclasses.replace(batch, pack=pack)


def unpack(packed, pack: Packing, t: int):
    """[R, L, ...] per-token values of a micro-batch -> [B, T, ...] (0 past each length)."""
    idx = pack.start[:, None] + jnp.arange(t)[None, :]  # [B, T]
    inside = jnp.arange(t)[None, :] < pack.length[:, None]
    idx = jnp.where(inside, idx, 0)
    out = packed[pack.row[:, None], idx]  # [B, T, ...]
    mask = inside.reshape(inside.shape + (1,) * (out.ndim - 2))
    return jnp.where(mask, out, jnp.zeros((), out.dtype))
