"""WeightStore on real kvstores: file, memory, s3 (moto server on loopback), gcs (spec only)."""

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts

from bridge.model import tiny_model
from bridge.store.chunk_digest import CHUNK_BYTES
from bridge.store.weight_store import (
    CorruptVersionError,
    ShardedSource,
    VersionExistsError,
    VersionNotFoundError,
    WeightStore,
    array_checksum,
    parse_spec,
)

CFG = tiny_model.tiny_config("qwen3")
BIG = "model.big.weight"  # 8 MiB fp32: two chunks


def _weights(seed=0):
    w = tiny_model.random_hf_weights(CFG, seed=seed)
    w[BIG] = np.random.default_rng(seed).standard_normal((2048, 1024)).astype(np.float32)
    return w


def _publish(store, version, weights, dtype="float32", **kw):
    return store.publish(version, version * 10, weights.items(), CFG.to_hf_dict(), dtype, **kw)


@pytest.fixture(params=["file", "memory"])
def store(request, tmp_path):
    if request.param == "file":
        return WeightStore(f"file://{tmp_path}/store")
    return WeightStore(f"memory://{request.node.name}")  # a name with "[...]" in it


def test_fp32_round_trip_is_bit_exact(store):
    w = _weights()
    m = _publish(store, 3, w, extra={"canary": {"ids": [1, 5], "logps": [-0.5, -1.25]}})
    assert store.versions() == [3] and store.latest() == 3
    assert m.total_bytes == sum(x.nbytes for x in w.values())
    assert m.arrays[BIG].chunks == (CHUNK_BYTES // (1024 * 4), 1024)
    back = WeightStore(store.spec).manifest(3)  # a second store object sees it
    assert back == m and back.hf_config == CFG.to_hf_dict() and back.step == 30
    assert json.loads(m.to_json())["model_config"]["hidden_size"] == CFG.hidden_size
    out = store.read_all(3)
    assert list(out) == list(w)
    for name, x in w.items():
        assert out[name].dtype == np.float32
        np.testing.assert_array_equal(out[name], x, err_msg=name)


def test_bf16_round_trip_equals_ml_dtypes_cast(store):
    w = _weights()
    m = _publish(store, 0, w, dtype="bfloat16")
    assert m.total_bytes == sum(x.size * 2 for x in w.values())
    for name, x in store.read(0, names=[BIG, "model.norm.weight"]):
        assert x.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(
            x.view(np.uint16), w[name].astype(ml_dtypes.bfloat16).view(np.uint16)
        )


def test_memory_stores_are_shared_per_name():
    a, b, c = (WeightStore(f"memory://shared_{s}") for s in ("x", "x", "y"))
    _publish(a, 1, {"w": np.ones((3, 2), np.float32)})
    assert b.versions() == [1] and c.versions() == []
    np.testing.assert_array_equal(b.read_all(1)["w"], np.ones((3, 2)))


def test_sharded_source_pieces_any_partition(store):
    x = np.arange(20 * 12, dtype=np.float32).reshape(20, 12)
    aligned = [((slice(r, r + 5), slice(c, c + 6)), x[r : r + 5, c : c + 6]) for r in (15, 0, 10, 5)
               for c in (6, 0)]  # fmt: skip
    ragged = [
        ((slice(0, 7), slice(0, 5)), x[:7, :5]),
        ((slice(7, 20), slice(None)), x[7:]),
        ((slice(0, 7), slice(5, 12)), x[:7, 5:]),
    ]
    _publish(store, 1, {"x": ShardedSource((20, 12), aligned, block_shape=(5, 6))})
    _publish(store, 2, {"x": ShardedSource((20, 12), ragged, block_shape=(4, 12))})
    assert store.manifest(1).arrays["x"].chunks == (5, 6)
    for v in (1, 2):
        np.testing.assert_array_equal(store.read_all(v)["x"], x)
        # The checksum does not depend on how the writer received the pieces.
        info = store.manifest(v).arrays["x"]
        assert info.checksum == array_checksum(x, info.chunks)


@pytest.mark.parametrize(
    "pieces, match",
    [
        ([((slice(0, 4), slice(None)), np.ones((4, 3)))], "cover 2 of 3 chunks"),
        ([((slice(0, 6), slice(None)), np.ones((6, 3)))] * 2, "overlap"),
        (
            [
                ((slice(0, 3), slice(0, 2)), np.ones((3, 2))),
                ((slice(1, 6), slice(None)), np.ones((5, 3))),
            ],
            "overlap",
        ),
        ([((slice(0, 7), slice(None)), np.ones((7, 3)))], "bad piece slice"),
        ([((slice(0, 6), slice(None)), np.ones((5, 3)))], "does not match block"),
        ([((slice(0, 6), slice(None)), np.ones((6, 3), np.int32))], "not a float weight"),
    ],
)
def test_bad_pieces_are_refused_and_leave_nothing(tmp_path, pieces, match):
    store = WeightStore(f"file://{tmp_path}")
    _publish(store, 1, {"ok": np.ones(4, np.float32)})
    src = ShardedSource((6, 3), pieces, block_shape=(2, 3))
    with pytest.raises(ValueError, match=match):
        _publish(store, 2, {"ok": np.ones(4, np.float32), "x": src})
    assert store.versions() == [1]
    assert _files(tmp_path / "data") == _files(tmp_path / "data" / "000000000001")  # no debris


def test_bad_names_are_refused(tmp_path):
    store = WeightStore(f"file://{tmp_path}")
    one = np.ones(4, np.float32)
    for arrays in ([("a", one), ("a", one)], [("a/b", one)], [("", one)], [], {"a": one}):
        with pytest.raises(ValueError, match="repeats|nothing to publish|pairs"):
            store.publish(1, 0, arrays, {})
    assert store.versions() == [] and _files(tmp_path / "data") == []


def test_versions_are_immutable_and_increasing(store):
    w = {"w": np.ones((4, 4), np.float32)}
    _publish(store, 5, w)
    with pytest.raises(VersionExistsError, match="already published"):
        _publish(store, 5, {"w": np.zeros((4, 4), np.float32)})
    with pytest.raises(ValueError, match="not newer than the latest 5"):
        _publish(store, 4, w)
    with pytest.raises(ValueError, match="store dtype"):
        _publish(store, 6, w, dtype="int8")
    assert store.versions() == [5]
    np.testing.assert_array_equal(store.read_all(5)["w"], 1.0)


def test_manifest_is_written_last(tmp_path):
    store = WeightStore(f"file://{tmp_path}")

    def arrays():  # the learner dies half way through a publish
        yield "a", np.ones((8, 8), np.float32)
        assert not store.versions()  # arrays on disk, still invisible
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store.publish(1, 1, arrays(), {})
    assert store.versions() == [] and store.latest() is None
    _publish(store, 2, {"a": np.ones((8, 8), np.float32)})
    os.remove(tmp_path / "manifests" / "000000000002.json")  # arrays without a manifest
    assert store.versions() == [] and store.latest() is None
    with pytest.raises(VersionNotFoundError, match="version 2 has no manifest"):
        store.read_all(2)


def _files(root):
    """Files under root, relative to tmp_path/data (the file driver leaves empty dirs)."""
    base = root if root.name == "data" else root.parent
    return sorted(p.relative_to(base) for p in root.rglob("*") if p.is_file())


def _chunk(tmp_path, version, name, *pos):
    return tmp_path / "data" / f"{version:012d}" / name / "c" / "/".join(map(str, pos))


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "stale"])
def test_damaged_chunk_is_detected(tmp_path, damage):
    store = WeightStore(f"file://{tmp_path}")
    w = _weights()
    _publish(store, 1, w)
    _publish(store, 2, _weights(seed=1))
    path = _chunk(tmp_path, 1, BIG, 1, 0)
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[12345] ^= 0x40
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "delete":
        path.unlink()
    else:  # a chunk of the same array from another version
        path.write_bytes(_chunk(tmp_path, 2, BIG, 1, 0).read_bytes())
    with pytest.raises(CorruptVersionError, match=f"version 1: array {BIG}"):
        store.read_all(1)
    ok = store.read_all(1, names=["model.norm.weight"])  # other arrays still verify
    np.testing.assert_array_equal(ok["model.norm.weight"], w["model.norm.weight"])


def test_manifest_shape_or_dtype_disagreeing_with_data_is_detected(tmp_path):
    store = WeightStore(f"file://{tmp_path}")
    _publish(store, 1, {"a": np.ones((8, 4), np.float32), "b": np.ones(3, np.float32)})
    path = tmp_path / "manifests" / "000000000001.json"
    m = json.loads(path.read_text())
    m["arrays"]["a"]["shape"] = [4, 8]
    m["arrays"]["b"]["dtype"] = "bfloat16"
    path.write_text(json.dumps(m))
    with pytest.raises(
        CorruptVersionError, match=r"array a has shape \(8, 4\), manifest says \(4, 8\)"
    ):
        store.read_all(1, names=["a"])
    with pytest.raises(
        CorruptVersionError, match="array b has dtype float32, manifest says bfloat16"
    ):
        store.read_all(1, names=["b"])
    path.write_text("{not json")
    with pytest.raises(CorruptVersionError, match="unreadable manifest"):
        store.manifest(1)


def test_gc_keeps_the_newest(tmp_path):
    store = WeightStore(f"file://{tmp_path}")
    for v in (1, 2, 4, 7):
        _publish(store, v, {"w": np.full((4,), v, np.float32)})
    with pytest.raises(ValueError, match="at least 1"):
        store.gc(0)
    assert store.gc(2) == [1, 2]
    assert store.versions() == [4, 7]
    assert {f.parts[0] for f in _files(tmp_path / "data")} == {"000000000004", "000000000007"}
    assert store.read_all(4)["w"][0] == 4
    assert store.gc(2) == [] and store.gc(5) == []
    assert store.gc(1) == [4] and store.versions() == [7]


def test_spec_parsing():
    assert parse_spec("file:///a/b") == {"driver": "file", "path": "/a/b/"}
    assert parse_spec("memory://run1") == {"driver": "memory", "path": "run1/"}
    assert parse_spec("s3://bkt/x/y") == {"driver": "s3", "bucket": "bkt", "path": "x/y/"}
    gcs = WeightStore("gs://my-bucket/runs/r1")  # building it touches no network
    assert gcs.spec == {"driver": "gcs", "bucket": "my-bucket", "path": "runs/r1/"}
    assert ts.KvStore.Spec(gcs.array_spec(3, "w")["kvstore"]).to_json() == {
        "driver": "gcs",
        "bucket": "my-bucket",
        "path": "runs/r1/data/000000000003/w/",
    }
    s3 = {"driver": "s3", "bucket": "bkt", "endpoint": "http://127.0.0.1:9", "aws_region": "x"}
    assert parse_spec(s3) == {**s3, "path": ""}
    for bad, match in [
        ("http://host/x", "unsupported store URL"),
        ("s3:///nobucket", "names no bucket"),
        ({"driver": "zarr3"}, "unsupported kvstore driver"),
        ({"driver": "gcs"}, "needs a bucket"),
        ({"driver": "s3", "bucket": "bkt", "endpoint": 3}, "endpoint"),
        ({"driver": "s3", "bucket": "b"}, "Invalid S3 bucket name"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_spec(bad)


MOTO_SERVER = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()
server.stop()
"""


@pytest.fixture(scope="module")
def s3_endpoint():
    """A real S3-compatible server (moto's server mode) on a free loopback port.

    It runs in its own process: importing moto's server pulls flask into this one, and
    flask's `current_app` proxy breaks vLLM's kernel registration (it probes every module
    attribute with hasattr) for any engine the same pytest session starts later.
    """
    import boto3

    old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
    # The server binds port 0 itself and prints the port it got: no free-port guess that
    # another process could take between our close and its bind. It runs until its stdin
    # closes.
    server = subprocess.Popen(
        [sys.executable, "-c", MOTO_SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = server.stdout.readline()
    assert line.strip().isdigit(), f"moto server did not start: {line!r}"
    endpoint = f"http://127.0.0.1:{int(line)}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    client.create_bucket(Bucket="echo2")  # listening before it printed the port
    yield endpoint
    server.stdin.close()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _s3_spec(endpoint, path):
    return {
        "driver": "s3",
        "bucket": "echo2",
        "path": path,
        "endpoint": endpoint,
        "aws_region": "us-east-1",
        "aws_credentials": {"type": "environment"},
    }


def test_s3_publish_read_gc(s3_endpoint):
    import boto3

    spec = _s3_spec(s3_endpoint, "runs/r1")
    store = WeightStore(spec)
    w = _weights()
    _publish(store, 1, w, dtype="bfloat16")
    _publish(store, 2, w)
    assert WeightStore(spec).versions() == [1, 2]
    out = store.read_all(2)
    for name, x in w.items():
        np.testing.assert_array_equal(out[name], x, err_msg=name)
    with pytest.raises(VersionExistsError):
        _publish(store, 2, w)
    assert store.gc(1) == [1]
    keys = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1").list_objects_v2(
        Bucket="echo2", Prefix="runs/r1/"
    )["Contents"]
    assert {tuple(k["Key"].split("/")[2:4]) for k in keys} == {
        ("manifests", "000000000002.json"),
        ("data", "000000000002"),
    }


def test_s3_carries_model_files_for_remote_workers(s3_endpoint, tiny_model_dir, tmp_path):
    from bridge.store import model_files

    spec = _s3_spec(s3_endpoint, "runs/files")
    store = WeightStore(spec)
    index = model_files.publish(store, tiny_model_dir)
    _publish(store, 1, _weights())
    _publish(store, 2, _weights())
    store.gc(1)  # gc removes versions, never the model files
    path = model_files.fetch(WeightStore(spec), str(tmp_path / "cache"))
    for name in index:
        with (
            open(os.path.join(path, name), "rb") as a,
            open(os.path.join(tiny_model_dir, name), "rb") as b,
        ):
            assert a.read() == b.read(), name


def test_a_manifest_of_another_checksum_algorithm_is_refused_by_name(tmp_path):
    # E.g. a store written while chunks were digested by CRC-32: its checksums cannot be
    # verified by this reader, so reading it fails by name rather than as a mismatch.
    store = WeightStore(f"file://{tmp_path}")
    _publish(store, 1, {"a": np.ones((8, 4), np.float32)})
    path = tmp_path / "manifests" / "000000000001.json"
    m = json.loads(path.read_text())
    m["checksum_algorithm"] = "crc32-chunks/sha256"
    path.write_text(json.dumps(m))
    with pytest.raises(CorruptVersionError, match="checksums are 'crc32-chunks/sha256'"):
        store.read_all(1)
