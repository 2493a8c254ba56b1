"""Per-step learner metrics: `<workdir>/metrics.jsonl` plus TensorBoard event files beside it.

metrics.jsonl holds one JSON object per learner step, flushed at once so a crash loses at
most the line being written; its field names are contracts (DESIGN.md, "Metrics").

The TensorBoard events are written here directly (TFRecord framing + the few protobuf
fields of `Event`/`Summary.Value` a scalar needs) instead of through tensorboardX: its
writer imports torch when torch is installed, and `learner_jax` never imports torch.
`tests/learner_jax/reporting/metrics_test.py` decodes the files with tensorboardX's own protos.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import socket
import struct
import time
from collections.abc import Mapping

import numpy as np

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"


def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 fields use two's complement varints
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _len_field(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def encode_event(wall_time: float, step: int, scalars=None, file_version: str | None = None):
    """Serialized `tensorboard.Event` with simple_value scalars (proto field numbers)."""
    ev = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if file_version is not None:
        ev += _len_field(3, file_version.encode())
    if scalars:
        summary = b"".join(
            _len_field(1, _len_field(1, tag.encode()) + b"\x15" + struct.pack("<f", value))
            for tag, value in scalars.items()
        )
        ev += _len_field(5, summary)
    return ev


def tfrecord(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return (
        header
        + struct.pack("<I", _masked_crc(header))
        + data
        + struct.pack("<I", _masked_crc(data))
    )


class EventFile:
    """An append-only TensorBoard event file of scalar summaries."""

    def __init__(self, logdir: str):
        os.makedirs(logdir, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.path = os.path.join(logdir, name)
        self._f = open(self.path, "ab")
        self._f.write(tfrecord(encode_event(time.time(), 0, file_version="brain.Event:2")))
        self._f.flush()

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        self._f.write(tfrecord(encode_event(time.time(), step, values)))
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _plain(v):
    """JSON-safe Python scalar from numpy/jax scalars; NaN/inf become None (strict JSON)."""
    if isinstance(v, (np.ndarray, np.generic)) or hasattr(v, "__array__"):
        v = np.asarray(v)
        if v.size != 1:
            raise ValueError(f"metric values must be scalars, got shape {v.shape}")
        v = v.item()
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, numbers.Integral):
        return int(v)
    if isinstance(v, numbers.Real):
        v = float(v)
        return v if math.isfinite(v) else None
    raise TypeError(f"unsupported metric value {v!r}")


class MetricsWriter:
    """Appends one JSON line per step to metrics.jsonl and mirrors numbers to TensorBoard.

    Appending (not truncating) keeps the lines of a run that was interrupted and resumed
    in the same workdir; readers take the last line of a step if a step repeats.
    """

    def __init__(self, workdir: str, tensorboard: bool = True, sinks=()):
        """`sinks`: more writers of each row (`write(row)`, `report(workdir)`, `close()`),
        e.g. learner_jax/reporting/wandb_sink.py's."""
        os.makedirs(workdir, exist_ok=True)
        self.sinks = list(sinks)
        self.path = os.path.join(workdir, METRICS_FILE)
        self._f = open(self.path, "a")
        self._tb = EventFile(os.path.join(workdir, TB_DIR)) if tensorboard else None

    def write(self, step: int, metrics: Mapping[str, object]) -> dict:
        row = {"step": int(step)}
        row.update({k: _plain(v) for k, v in metrics.items() if k != "step"})
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        if self._tb is not None:
            nums = {
                k: float(v)
                for k, v in row.items()
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
            }
            self._tb.scalars(row["step"], nums)
        for sink in self.sinks:
            sink.write(row)
        return row

    def report(self, workdir: str) -> None:
        """Hand the finished report (eval table, plots) to the sinks."""
        for sink in self.sinks:
            sink.report(workdir)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()
        for sink in self.sinks:
            sink.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_jsonl(path: str) -> list[dict]:
    """The rows of a JSON-lines file (metrics, eval, swaps); [] when it does not exist yet."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_metrics(workdir: str) -> list[dict]:
    return read_jsonl(os.path.join(workdir, METRICS_FILE))
