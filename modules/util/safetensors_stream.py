"""Safetensors files written one tensor at a time.

`safetensors.torch.save_file` takes every tensor at once: a save that casts, dequantises or copies from the GPU
first builds the whole converted state dict on the host, a second copy of the model beside the live one. The format
does not need it: its header holds only each tensor's dtype, shape and byte range, all known before any tensor is
made. Here the header is written first and then each tensor is made (a `Deferred` runs its function), moved to the
host, written and dropped before the next, so a save holds at most one converted tensor at a time.

The layout is the format's own (little-endian u64 header length, the JSON header padded with spaces to a multiple
of 8 bytes, the data in header order, each tensor's bytes at its `data_offsets`), in safetensors' own order (its
dtypes' rank, falling, then the name): the same tensors give the same bytes as `save_file`.
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch

DTYPE_NAMES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64", torch.complex64: "C64",
}


# safetensors' own dtype order (its Rust `Dtype` enum); files list tensors by falling rank, then name
_RANK = {name: rank for rank, name in enumerate(
    ["BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16",
     "I32", "U32", "F32", "C64", "F64", "I64", "U64"])}


class Deferred(NamedTuple):
    """A tensor made only when it is written: `make()` must return `dtype` and `shape`."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    make: Callable[[], torch.Tensor]


def materialise(value: torch.Tensor | Deferred) -> torch.Tensor:
    return value.make() if isinstance(value, Deferred) else value


def _layout(tensors: Mapping[str, torch.Tensor | Deferred]) -> tuple[list[str], dict]:
    header: dict[str, dict] = {}
    for name, value in tensors.items():
        if value.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {value.dtype} has no safetensors name")
    order = sorted(tensors, key=lambda name: (-_RANK[DTYPE_NAMES[tensors[name].dtype]], name))
    offset = 0
    for name in order:
        value = tensors[name]
        size = value.dtype.itemsize
        for dim in value.shape:
            size *= int(dim)
        header[name] = {"dtype": DTYPE_NAMES[value.dtype], "shape": [int(d) for d in value.shape],
                        "data_offsets": [offset, offset + size]}
        offset += size
    return order, header


def write_safetensors(tensors: Mapping[str, torch.Tensor | Deferred], path: str | os.PathLike,
                      metadata: Mapping[str, str] | None = None) -> None:
    """Writes `tensors` (tensors on any device, or `Deferred`s) to `path`, one tensor in host memory at a time."""
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError("safetensors metadata must map strings to strings")
    order, header = _layout(tensors)
    if metadata:
        header = {"__metadata__": dict(metadata), **header}
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(raw)))
        file.write(raw)
        for name in order:
            tensor = materialise(tensors[name]).detach()
            entry = header[name]
            if tensor.dtype != tensors[name].dtype or list(tensor.shape) != entry["shape"]:
                raise ValueError(f"tensor {name!r} was announced as {tensors[name].dtype} {entry['shape']} but "
                                 f"made as {tensor.dtype} {list(tensor.shape)}")
            tensor = tensor.to("cpu").contiguous()
            if tensor.numel():
                file.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
            del tensor
