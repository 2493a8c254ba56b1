"""Model files (config + tokenizer) through the weight store: publish once, fetch verified."""

import filecmp
import json
import os

import pytest
import tensorstore as ts
import transformers

from bridge.store import model_files
from bridge.store.model_files import ModelFilesError
from bridge.store.weight_store import WeightStore


@pytest.fixture
def store(tmp_path):
    return WeightStore(f"file://{tmp_path}/store")


def test_fetch_gives_the_published_files_and_a_loadable_tokenizer(store, tiny_model_dir, tmp_path):
    index = model_files.publish(store, tiny_model_dir)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= set(index)
    assert not any(n.endswith(".safetensors") for n in index)  # weights travel as versions
    path = model_files.fetch(WeightStore(store.spec), str(tmp_path / "cache"))
    for name in index:
        assert filecmp.cmp(os.path.join(path, name), os.path.join(tiny_model_dir, name), False)
    # An independent reader (transformers) builds the same tokenizer from the fetched copy.
    want = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    got = transformers.AutoTokenizer.from_pretrained(path)
    assert got("12+34=")["input_ids"] == want("12+34=")["input_ids"]
    assert model_files.fetch(store, str(tmp_path / "cache")) == path  # cached
    assert model_files.publish(store, tiny_model_dir) == index  # a resumed run: no change


def test_another_model_in_the_same_store_is_refused(store, tiny_model_dirs):
    model_files.publish(store, tiny_model_dirs["qwen3"])
    with pytest.raises(ModelFilesError, match="another model"):
        model_files.publish(store, tiny_model_dirs["llama"])


def test_missing_index_names_the_fix(store, tmp_path):
    with pytest.raises(ModelFilesError, match="--model_dir"):
        model_files.fetch(store, str(tmp_path / "cache"))


def _tamper(store, key, value):
    store.kv.write(key, value).result()


@pytest.mark.parametrize(
    "attack, match",
    [
        ("corrupt_file", "do not match"),
        ("missing_file", "missing"),
        ("path_name", "not allowed"),
        ("weights_name", "not allowed"),
        ("garbage_index", "unreadable"),
    ],
)
def test_bad_store_contents_are_refused_and_leave_no_directory(
    store, tiny_model_dir, tmp_path, attack, match
):
    index = model_files.publish(store, tiny_model_dir)
    if attack == "corrupt_file":
        _tamper(store, "model/files/tokenizer.json", b'{"model": "evil"}')
    elif attack == "missing_file":
        key = "model/files/tokenizer.json"
        store.kv.delete_range(ts.KvStore.KeyRange(key, key + "\0")).result()
    elif attack in ("path_name", "weights_name"):
        bad = "../../.bashrc" if attack == "path_name" else "model.safetensors"
        index[bad] = {"sha256": "0" * 64, "bytes": 1}
        _tamper(store, model_files.INDEX_KEY, json.dumps(index).encode())
    else:
        _tamper(store, model_files.INDEX_KEY, b"[1, 2")
    cache = tmp_path / "cache"
    with pytest.raises(ModelFilesError, match=match):
        model_files.fetch(store, str(cache))
    assert not cache.exists() or os.listdir(cache) == []
