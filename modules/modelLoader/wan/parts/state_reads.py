"""Fills a meta-built model's state from a weight file one tensor at a time, with one copy of the weights in memory.

- A tensor already in its target dtype is used as read: a fresh buffer (safetensors, read with pread) or, from a
  `.pth`, the memory-mapped tensor itself (no copy at all; its pages are read on first touch).
- A tensor that is cast (fp16 -> bf16, fp8_scaled -> bf16) gets its final storage before any tensor is read; each
  read then lands in a short-lived buffer that is copied over and freed. Allocating the kept tensors between freed
  read buffers instead leaves the freed ones as holes in the C heap that the kept ones do not fill: measured on
  ViT-H/14 from an fp16 safetensors file into bf16, a peak of 1.3x to 2.0x the file (varying with allocator state),
  against 1.04x with the storage allocated first.
- The pages of a memory-mapped `.pth` tensor that was cast are handed back to the kernel once it is copied
  (madvise MADV_DONTNEED: the mapping is private and never written, so a later touch would read the file again);
  otherwise they stay in the resident set until the file is closed, a second copy at the peak (measured 2.0x).
"""
import ctypes
import mmap
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from modules.modelLoader.wan.parts.tensor_files import PICKLE_MODEL_SUFFIXES, LazyTensors

_MADV_DONTNEED = 4   # Linux <sys/mman.h>
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


@dataclass(frozen=True)
class TensorRead:
    key: str                       # the tensor in the file
    shape: tuple[int, ...]         # in the model
    dtype: torch.dtype             # in the model
    file_dtype: str                # in the file (torch's name, from the header)
    take: Callable[[torch.Tensor, LazyTensors], torch.Tensor] | None = None   # slice / reshape / dequantise


def _release_mapped_pages(tensor: torch.Tensor) -> None:
    """Drops the whole pages of a memory-mapped tensor's storage from the resident set (Linux; elsewhere a no-op)."""
    if _libc is None:
        return
    storage = tensor.untyped_storage()
    begin, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    page = mmap.PAGESIZE
    first, last = -(-begin // page) * page, end // page * page
    if last > first:
        _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


def read_state(tensors: LazyTensors, reads: Mapping[str, TensorRead]) -> dict[str, torch.Tensor]:
    """model name -> tensor, each `reads[name]` taken from `tensors` (see the module docstring for the memory)."""
    def mapped(read: TensorRead) -> bool:
        return tensors.file_of(read.key).name.lower().endswith(PICKLE_MODEL_SUFFIXES)

    def as_read(read: TensorRead) -> bool:
        return read.file_dtype == str(read.dtype).removeprefix("torch.")

    state = {name: torch.empty(read.shape, dtype=read.dtype) for name, read in reads.items() if not as_read(read)}
    last: tuple[TensorRead, torch.Tensor] | None = None   # a fused tensor (q, k, v) is read once for its parts

    def done_with(previous: tuple[TensorRead, torch.Tensor] | None) -> None:
        if previous is not None and mapped(previous[0]) and not as_read(previous[0]):
            _release_mapped_pages(previous[1])

    for name, read in reads.items():
        if last is None or last[0].key != read.key:
            done_with(last)
            last = (read, tensors[read.key])
        tensor = read.take(last[1], tensors) if read.take is not None else last[1]
        if name in state:
            state[name].copy_(tensor)
        else:
            state[name] = tensor
        del tensor
    done_with(last)
    return state
