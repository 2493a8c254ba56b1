"""The model's small HF files (config, tokenizer) in the weight store, for remote workers.

    model_files.publish(store, hf_dir)          # learner, once per run (idempotent)
    path = model_files.fetch(store, cache_dir)  # worker without --model_dir

A rollout worker needs an HF directory to start vLLM (config.json + tokenizer); the weights
come later, through the verified swap (rollout_gpu/weight_swap.py). Putting these few files
beside the versions lets a worker on another machine start from the controller URL and the
join secret alone. Layout under the store's path:

    model/files/<name>   the bytes of each file
    model/index.json     {name: {"sha256": hex, "bytes": n}}, written last and create-only

`fetch` trusts nothing it reads: names must be plain file names from a fixed allow-list
(`bridge.model.hf_files.ENGINE_FILES`, the files vLLM and transformers read),
sizes are bounded, every file must match its sha256; the files land in
`<cache_dir>/<index sha256>/` via a temporary directory renamed into place, so a worker
never starts from a half-written directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

from bridge.model.hf_files import CONFIG, ENGINE_FILES, model_files
from bridge.store.weight_store import WeightStore

MAX_FILE_BYTES = 64 << 20  # a large BPE tokenizer.json is ~10 MB
INDEX_KEY = "model/index.json"


class ModelFilesError(RuntimeError):
    """The store has no usable model files (missing, corrupt or not allowed)."""


def _index(files: dict[str, bytes]) -> bytes:
    entries = {
        n: {"sha256": hashlib.sha256(b).hexdigest(), "bytes": len(b)} for n, b in files.items()
    }
    return json.dumps(entries, sort_keys=True).encode()


def publish(store: WeightStore, hf_dir: str) -> dict:
    """Copies the allowed files of `hf_dir` into the store once; returns the index.

    Idempotent: a resumed run finds the same index and writes nothing. A different index
    (another model in the same store) is an error rather than a silent overwrite.
    """
    files = {}
    for name in model_files(hf_dir, ENGINE_FILES):
        with open(os.path.join(hf_dir, name), "rb") as f:
            files[name] = f.read()
    if CONFIG not in files:
        raise ModelFilesError(f"{hf_dir} has no config.json")
    index = _index(files)
    existing = store.kv.read(INDEX_KEY).result()
    if existing.state == "value":
        if existing.value != index:
            raise ModelFilesError(
                f"{store.spec} already holds the files of another model; use a fresh store"
            )
        return json.loads(index)
    for name, data in files.items():
        store.kv.write(f"model/files/{name}", data).result()
    store.kv.write(INDEX_KEY, index).result()  # last: readers see all files or none
    return json.loads(index)


def fetch(store: WeightStore, cache_dir: str) -> str:
    """A local directory holding the store's verified model files (downloaded once)."""
    r = store.kv.read(INDEX_KEY).result()
    if r.state != "value":
        raise ModelFilesError(
            f"{store.spec} has no model files (the learner publishes them with its first "
            "version); pass --model_dir to start from a local HF directory instead"
        )
    if len(r.value) > 1 << 20:
        raise ModelFilesError(f"model index is {len(r.value)} bytes; refusing")
    try:
        index = json.loads(r.value)
        entries = {str(n): (str(e["sha256"]), int(e["bytes"])) for n, e in index.items()}
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ModelFilesError(f"unreadable model index: {e}") from e
    bad = sorted(n for n in entries if n not in ENGINE_FILES)
    if bad or CONFIG not in entries:
        raise ModelFilesError(
            f"model index lists files that are not allowed or lacks config: {bad}"
        )
    dest = os.path.join(cache_dir, hashlib.sha256(r.value).hexdigest()[:16])
    if os.path.isdir(dest):
        return dest  # complete: directories appear only by rename
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_dir, prefix=".partial-")
    try:
        for name, (sha, size) in entries.items():
            if size > MAX_FILE_BYTES:
                raise ModelFilesError(f"{name}: {size} bytes is over the {MAX_FILE_BYTES} limit")
            got = store.kv.read(f"model/files/{name}").result()
            if got.state != "value":
                raise ModelFilesError(f"{name} is listed in the model index but missing")
            if len(got.value) != size or hashlib.sha256(got.value).hexdigest() != sha:
                raise ModelFilesError(f"{name}: contents do not match the model index")
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(got.value)
        try:
            os.rename(tmp, dest)
        except OSError:  # another worker on this machine finished first
            if not os.path.isdir(dest):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
