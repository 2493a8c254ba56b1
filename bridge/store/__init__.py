"""The versioned weight store: tensorstore kvstores, chunk digests, model files.

`weight_store.py` writes and reads immutable versions (arrays first, manifest last) on
file/memory/s3/gcs specs; `layout.py` (`LAYOUT`) says where a version's manifest, arrays
and chunks live; `manifest.py` is what a version's manifest holds; `chunk_digest.py`
checksums chunk by chunk so each host can digest its own shards; `sharded_publish.py`
writes one version from several processes; `model_files.py` puts config + tokenizer beside
the versions so a remote worker needs no local model copy.
"""
