"""The versioned weight store: tensorstore kvstores, chunk digests, model files.

`weight_store.py` writes and reads immutable versions (arrays first, manifest last) on
file/memory/s3/gcs specs; `chunk_digest.py` checksums chunk by chunk so each host can
digest its own shards; `model_files.py` puts config + tokenizer beside the versions so a
remote worker needs no local model copy.
"""
