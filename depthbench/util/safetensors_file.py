"""A safetensors writer whose bytes depend only on the tensors and the metadata.

The safetensors library keeps a file's `__metadata__` in a hash map with a per-process random
seed, so a file with two or more metadata keys (the final weights carry `run_id` and `step`) is
written with its keys in either order: two trainings with equal tensors publish files whose
SHA-256 differ, and the `weights_sha256` a summary records cannot be compared across runs. This
writer lays out the same format with everything in a fixed order:

    8 bytes    N, the header's length, unsigned little-endian
    N bytes    the header: compact JSON, `__metadata__` first (keys sorted), then one entry per
               tensor, {"dtype", "shape", "data_offsets": [begin, end]}, padded with spaces so
               that the data starts 8-byte aligned
    the data   each tensor's bytes, C order, little-endian, in the header's order

(the format: https://github.com/huggingface/safetensors#format). Tensors are ordered as the
library orders them, by dtype (`DTYPE_ORDER`: wider elements first, so every tensor's data is
aligned to its element size) and then by name; with one metadata key or none the bytes equal the
library's own, and files load with its `load_file` and `safe_open` like its own.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Mapping

# torch dtype name -> the format's dtype code
DTYPE_CODES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
# the library's order of dtypes in a file (its Dtype enum, descending)
DTYPE_ORDER = (
    "I64",
    "F64",
    "F32",
    "I32",
    "BF16",
    "F16",
    "I16",
    "F8_E4M3",
    "F8_E5M2",
    "I8",
    "U8",
    "BOOL",
)
ALIGN = 8


def save_safetensors(
    tensors: Mapping, path: str | os.PathLike, metadata: Mapping | None = None
) -> None:
    """Write `tensors` (name -> torch.Tensor, on any device) and `metadata` (str -> str) to
    `path` as safetensors; equal arguments give equal bytes in every process. ValueError naming
    the tensor or key for a dtype the format has no code for, or metadata that is not strings."""
    import torch

    if sys.byteorder != "little":  # the format's data is little-endian; torch writes native order
        raise ValueError("safetensors files are little-endian; this machine is big-endian")
    header: dict = {}
    if metadata is not None:
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ValueError(
                    f"safetensors metadata must map strings to strings; {key!r}: {value!r}"
                )
        header["__metadata__"] = dict(sorted(metadata.items()))
    entries = []
    for name, tensor in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"tensor name {name!r}: names are strings other than '__metadata__'")
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in DTYPE_CODES:
            raise ValueError(
                f"tensor {name!r}: dtype {dtype} has no safetensors code (valid: "
                f"{', '.join(DTYPE_CODES)})"
            )
        entries.append((DTYPE_ORDER.index(DTYPE_CODES[dtype]), name, tensor))
    blobs = []
    offset = 0
    for rank, name, tensor in sorted(entries, key=lambda entry: entry[:2]):
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        header[name] = {
            "dtype": DTYPE_ORDER[rank],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + data.nbytes],
        }
        blobs.append(data)
        offset += data.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-(8 + len(text)) % ALIGN)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for data in blobs:
            f.write(memoryview(data))
