"""Recorded MoE routing: the experts a worker's engine routed each token to, as data.

Both stacks use this module (numpy only): the worker encodes what its engine recorded
(rollout_gpu/routing_capture.py), the controller decodes and checks it at intake, and the
learner replays it (`model.moe.routing_replay=rollout`) and audits it against its own.

Shape: int [rows, L, k], L the model's sparse layers in order (`ModelConfig.moe_layers`),
k experts per token. rows = P + C - 1 for P prompt and C completion tokens: one row per
position the engine forwarded. Row j is token j as the model's input (its output predicts
token j + 1), so completion token i was produced by row P - 1 + i: the last C rows are one
per completion token, and the first P - 1 are the prompt's, which replay needs too (the
completion attends to the prompt's hidden states, computed with the prompt's routing). The
last token is never forwarded, so it has no row.

Wire encoding (`protocol.RoutedExperts.ids`): little-endian uint16, row-major, base64;
~1 KB a token at Qwen3-30B-A3B's shape (48 layers x 8 experts x 2 bytes, base64 4/3),
where JSON integer lists would cost ~2.5x and a slow parse.

A row is valid when it holds k distinct experts in [0, E) for each layer; the order within
a row carries no meaning (the learner takes its own gate weights over the recorded set).
"""

from __future__ import annotations

import base64
import binascii

import numpy as np

WIRE_DTYPE = np.dtype("<u2")
MAX_EXPERTS = 1 << 16  # uint16 on the wire


class RoutingError(ValueError):
    """Recorded routing that does not fit the model or the trajectory (message says how)."""


def num_rows(prompt_len: int, completion_len: int) -> int:
    return prompt_len + completion_len - 1


def encode(ids: np.ndarray) -> dict:
    """[rows, L, k] expert ids -> the `RoutedExperts` wire fields."""
    ids = np.asarray(ids)
    if ids.ndim != 3:
        raise RoutingError(f"routing must be [rows, layers, k], got shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= MAX_EXPERTS):
        raise RoutingError(f"expert ids must be in [0, {MAX_EXPERTS}) to encode")
    data = np.ascontiguousarray(ids, dtype=WIRE_DTYPE).tobytes()
    return {
        "num_layers": int(ids.shape[1]),
        "k": int(ids.shape[2]),
        "ids": base64.b64encode(data).decode(),
    }


def decode(num_layers: int, k: int, ids: str) -> np.ndarray:
    """The wire fields -> int32 [rows, num_layers, k]; RoutingError if they do not fit."""
    try:
        raw = base64.b64decode(ids, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RoutingError(f"routing ids are not base64: {e}") from None
    per_row = num_layers * k * WIRE_DTYPE.itemsize
    if per_row == 0 or len(raw) % per_row:
        raise RoutingError(
            f"routing has {len(raw)} bytes, not a whole number of rows of {num_layers} "
            f"layers x {k} experts x {WIRE_DTYPE.itemsize} bytes"
        )
    flat = np.frombuffer(raw, dtype=WIRE_DTYPE)
    return flat.reshape(-1, num_layers, k).astype(np.int32)


def check(ids: np.ndarray, *, rows: int, num_layers: int, k: int, num_experts: int) -> None:
    """RoutingError unless `ids` is [rows, num_layers, k] with k distinct experts in
    [0, num_experts) for every row and layer."""
    if ids.shape != (rows, num_layers, k):
        raise RoutingError(
            f"routing shape {tuple(ids.shape)}, expected ({rows}, {num_layers}, {k}): one row "
            "per forwarded position (prompt + completion - 1), one per sparse layer, k experts"
        )
    if ids.size == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_experts:
        bad = lo if lo < 0 else hi
        raise RoutingError(f"expert id {bad} outside [0, {num_experts})")
    s = np.sort(ids, axis=-1)
    dup = np.argwhere(s[..., 1:] == s[..., :-1])
    if len(dup):
        row, layer, _ = (int(x) for x in dup[0])
        raise RoutingError(
            f"row {row} layer {layer} names expert {int(s[row, layer][dup[0][2]])} twice; "
            f"each token goes to {k} distinct experts"
        )


# The audit's rule (bridge/control/trust/audit.py): an identity whose recorded experts differ
# from the learner's own top-k on more than DISAGREE_THRESHOLD of its (token, layer) expert
# slots, after MIN_ROWS (token, layer) rows, is quarantined.
#
# Honest rate, measured (python -m bench.moe_routing --out=F.json): a bf16 vLLM engine
# against float32 routing of the same weights (transformers' router, which the learner's
# equals up to float32 rounding), tiny Qwen3-MoE (8 experts, 2 a token, 2 layers), 64
# samples of 13 + 32 tokens at T = 1: 1.13% of (token, layer) rows hold another expert
# set, 0.57% of expert slots differ. A random tiny MoE's router logits are small and close
# (weights of std 0.02), so near-ties, the only place rounding flips a choice, are common;
# bf16 engines on trained MoEs are reported at a few percent of tokens with any flip. A
# forger's made-up experts agree by chance k/E of the time (tiny: 25%, Qwen3-30B-A3B: 6%),
# i.e. differ on 75-94% of slots. 20% sits 35x above the honest tiny rate and far below a
# forger's; a worker that forges fewer than a fifth of its slots steers correspondingly
# little and is still seen in `moe/routing_agreement`.
HONEST_BF16_RATE = 0.0057
DISAGREE_THRESHOLD = 0.2
MIN_ROWS = 2048
