"""metrics.jsonl lines and the TensorBoard event files, decoded with tensorboardX's own
protobufs and CRC (an independent implementation of the format we write by hand)."""

import json
import os
import struct

import numpy as np
import pytest

from learner_jax.reporting import metrics


def read_records(path):
    from tensorboardX.crc32c import crc32c

    def masked(data):
        crc = crc32c(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    with open(path, "rb") as f:
        blob = f.read()
    out, i = [], 0
    while i < len(blob):
        header = blob[i : i + 8]
        (n,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", blob[i + 8 : i + 12])[0] == masked(header)
        data = blob[i + 12 : i + 12 + n]
        assert struct.unpack("<I", blob[i + 12 + n : i + 16 + n])[0] == masked(data)
        out.append(data)
        i += 16 + n
    return out


def test_jsonl_and_tensorboard(tmp_path):
    from tensorboardX.proto.event_pb2 import Event

    with metrics.MetricsWriter(str(tmp_path)) as w:
        w.write(1, {"loss": np.float32(0.5), "phase": "sft", "reward/mean": 1})
        w.write(2, {"loss": float("nan"), "time/step_s": 0.25, "big_step": 2**40})
    rows = metrics.read_metrics(str(tmp_path))
    assert rows == [
        {"step": 1, "loss": 0.5, "phase": "sft", "reward/mean": 1},
        {"step": 2, "loss": None, "time/step_s": 0.25, "big_step": 2**40},
    ]
    with open(tmp_path / "metrics.jsonl") as f:
        for line in f:
            json.loads(line)  # strict JSON: no NaN tokens

    (name,) = os.listdir(tmp_path / "tb")
    events = [Event.FromString(r) for r in read_records(str(tmp_path / "tb" / name))]
    assert events[0].file_version == "brain.Event:2"
    scalars = {(e.step, v.tag): v.simple_value for e in events[1:] for v in e.summary.value}
    assert scalars == {
        (1, "loss"): 0.5,
        (1, "reward/mean"): 1.0,
        (2, "time/step_s"): 0.25,
        (2, "big_step"): float(2**40),
    }
    assert all(e.wall_time > 1e9 for e in events)


def test_appends_across_writers_and_rejects_non_scalars(tmp_path):
    with metrics.MetricsWriter(str(tmp_path), tensorboard=False) as w:
        w.write(1, {"loss": 1.0})
        with pytest.raises(ValueError, match="scalars"):
            w.write(2, {"loss": np.zeros(3)})
    with metrics.MetricsWriter(str(tmp_path), tensorboard=False) as w:
        w.write(2, {"loss": 2.0})
    assert [r["step"] for r in metrics.read_metrics(str(tmp_path))] == [1, 2]


def test_crc32c_known_value():
    # RFC 3720 test vector: 32 bytes of zeros.
    assert metrics.crc32c(bytes(32)) == 0x8A9136AA
