"""Triton's tensor datatypes and NumPy's names for them: what Triton's metadata says of a model's
tensors, and what the gateway sends."""

from __future__ import annotations

TRITON_TYPES = {
    "FP32": "float32", "FP16": "float16", "FP64": "float64", "BF16": "bfloat16", "UINT8": "uint8",
    "UINT16": "uint16", "UINT32": "uint32", "UINT64": "uint64", "INT8": "int8", "INT16": "int16",
    "INT32": "int32", "INT64": "int64", "BOOL": "bool", "BYTES": "bytes",
}  # fmt: skip
"""Triton's datatype names to NumPy's (``TensorFacts.dtype``)."""
DATATYPES = {numpy: triton for triton, numpy in TRITON_TYPES.items()}
