"""Dtypes by name: the one table every side of the weight bridge reads.

`WEIGHT_DTYPES` are the dtypes weights cross the bridge in: what the store publishes, what
the export writes and what a worker accepts. Keys are numpy's names (`np.dtype(t).name`),
which is also how the manifest, the HF config's `torch_dtype` and the flags spell them;
bfloat16 comes from `ml_dtypes`, numpy has none. `SAFETENSORS_DTYPES` maps a safetensors
header's dtype code to numpy, for reading checkpoints from their raw bytes.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

WEIGHT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def itemsize(name: str) -> int:
    """Bytes per element of a weight dtype."""
    return np.dtype(WEIGHT_DTYPES[name]).itemsize
