"""Page-locked host memory of the exact size asked for.

PyTorch's `pin_memory()` (and `torch.empty(pin_memory=True)`) takes page-locked memory from its caching host
allocator, which rounds every allocation up to the next power of two: a 141 MB feed-forward weight takes 256 MB,
and block swap's host copies of a 14B transformer took about 17 GiB for 11 GiB of weights. Here a plain host
allocation of the exact size is page-locked once with `cudaHostRegister` (no rounding) and unregistered when it is
released:

- `PinnedArena`: many tensors in one allocation, each a view at an aligned offset (`layout`, shared with
  modules/trainer/shared_host.py); block swap keeps its swapped blocks' host copies in one.
- `PinnedPool`: exact-size buffers handed out and taken back for reuse (activation offload's block inputs, the
  same sizes every step).

Without `pin` (a CPU device, tests) the same allocations and views are made without the registration: only the
`cudaHostRegister` / `cudaHostUnregister` calls in `page_lock` / `page_unlock` need a CUDA device.
"""
from __future__ import annotations

import logging
import mmap
import weakref

import torch

log = logging.getLogger(__name__)

ALIGNMENT = 64   # every tensor starts on a cache line (and so on its own element size)
PAGE = mmap.PAGESIZE   # the registered range starts on a page


def layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """(each tensor's byte offset, the total bytes) of `tensors` packed one after another, each aligned."""
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // ALIGNMENT) * ALIGNMENT
    return offsets, max(total, ALIGNMENT)


def views(buffer: torch.Tensor, like: list[torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
    """Tensors of `like`'s dtypes and shapes at `offsets` of the uint8 `buffer` (its values, not `like`'s)."""
    return [buffer[offset:offset + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
            for tensor, offset in zip(like, offsets)]


def page_lock(buffer: torch.Tensor) -> bool:
    """Page-locks a contiguous host tensor's memory for asynchronous copies to the GPU; False (and a warning)
    when the driver refuses: copies from it are then synchronous, with the same results."""
    error = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0)
    if int(error) != 0:
        log.warning("%.1f MiB of host memory could not be page-locked (CUDA error %s): copies from it to the GPU "
                    "are synchronous", buffer.numel() * buffer.element_size() / 2 ** 20, int(error))
        return False
    return True


def page_unlock(pointer: int) -> None:
    """Undoes `page_lock` (before the memory is freed)."""
    torch.cuda.cudart().cudaHostUnregister(pointer)


class PinnedBuffer:
    """`nbytes` of host memory (uint8, starting on a page); `lock` page-locks it, `release` (or the buffer's
    collection) unregisters it, after which it is ordinary memory that lives as long as a view of it."""

    def __init__(self, nbytes: int):
        raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)   # untouched pages: RSS grows as they are written
        start = -raw.data_ptr() % PAGE
        self.bytes = raw[start:start + nbytes]
        self.nbytes = nbytes
        self._unlock = None

    @property
    def pinned(self) -> bool:
        return self._unlock is not None and self._unlock.alive

    def lock(self) -> bool:
        if not self.pinned and page_lock(self.bytes):
            # unregistered before the memory can be freed: the finalizer runs when this buffer is collected, and
            # the memory (held by `self.bytes`) outlives it
            self._unlock = weakref.finalize(self, page_unlock, self.bytes.data_ptr())
        return self.pinned

    def release(self) -> None:
        if self._unlock is not None:
            self._unlock()


class PinnedArena:
    """Room for tensors like `like` in one `PinnedBuffer` of the exact (aligned) size: `views[i]` has `like[i]`'s
    dtype and shape (its values not copied: the caller fills the views one by one and can drop each source as it
    goes, so the sources and the arena are not both whole in memory). `lock` page-locks it once it is filled."""

    def __init__(self, like: list[torch.Tensor]):
        offsets, size = layout(like)
        self.buffer = PinnedBuffer(size)
        self.views = views(self.buffer.bytes, like, offsets)

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    def lock(self) -> bool:
        return self.buffer.lock()

    def release(self) -> None:
        self.buffer.release()


class PinnedPool:
    """Exact-size buffers for tensors that come and go in the same sizes (a step's offloaded block inputs): `take`
    hands out a free buffer large enough (the smallest such) or a new one, `give` takes it back. A new buffer first
    drops the free ones smaller than it, so buckets of several sizes end at the largest one's buffers, not one set
    per size."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.free: list[PinnedBuffer] = []
        self.created = 0   # buffers made (a step that reuses its buffers makes none)

    def take(self, nbytes: int) -> PinnedBuffer:
        fitting = [buffer for buffer in self.free if buffer.nbytes >= nbytes]
        if fitting:
            buffer = min(fitting, key=lambda b: b.nbytes)
            self.free.remove(buffer)
            return buffer
        for small in self.free:
            small.release()
        self.free.clear()
        self.created += 1
        buffer = PinnedBuffer(nbytes)
        if self.pin:
            buffer.lock()
        return buffer

    def give(self, buffer: PinnedBuffer) -> None:
        self.free.append(buffer)

    def clear(self) -> None:
        """Unregisters and drops the free buffers (a buffer handed out stays its holder's): the next `take` makes
        new ones. Between steps every buffer is free."""
        for buffer in self.free:
            buffer.release()
        self.free.clear()

    @property
    def held_bytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.free)

    @staticmethod
    def tensor(buffer: PinnedBuffer, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A `shape` x `dtype` tensor at the start of `buffer`."""
        return buffer.bytes[:shape.numel() * dtype.itemsize].view(dtype).view(shape)
