"""Counts the bytes of tensor storages alive while code runs, to bound a loader's peak host memory.

Every tensor an aten operator returns (empty, to, copy, cat, ...) is seen by a TorchDispatchMode; its storage is
recorded once (by its address) with a weak reference, and after each operator the storages still alive are summed.
A storage's bytes count from the operator that made it until its last tensor dies, so a whole-model copy in another
dtype shows as such however briefly it lives. Tensors that are views of a memory-mapped file (safetensors' reads)
are made without an operator and are not counted: their pages belong to the file and the kernel can drop them.
tracemalloc would see none of this (torch allocates outside Python's allocator), and RSS of a tiny model is noise.
"""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class AliveBytes(TorchDispatchMode):
    def __init__(self, existing: tuple[torch.Tensor, ...] = ()):
        """`existing`: tensors alive before (a model being saved): views of their storages count nothing."""
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.existing = {t.untyped_storage().data_ptr() for t in existing}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                storage = value.untyped_storage()
                key = storage.data_ptr()
                known = self.storages.get(key)
                if storage.nbytes() and key not in self.existing and (known is None or known[0].expired()):
                    self.storages[key] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, self.alive())
        return out

    def alive(self) -> int:
        self.storages = {k: v for k, v in self.storages.items() if not v[0].expired()}
        return sum(size for _, size in self.storages.values())


def module_bytes(module: torch.nn.Module) -> int:
    """The bytes of a module's parameters and buffers, each storage once."""
    seen = {}
    for tensor in list(module.parameters()) + list(module.buffers()):
        if tensor.device.type != "meta":
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(seen.values())
