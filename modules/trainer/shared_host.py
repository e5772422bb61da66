"""One host copy of the frozen weights that several ranks on one machine keep in host memory.

Data-parallel ranks with block swap each hold the swapped blocks' frozen weights in host memory, the same bytes in
every process: N ranks on one machine held N copies. Here the machine's first rank (LOCAL_RANK 0) writes them once
into a file in shared memory (/dev/shm, else the temporary folder when /dev/shm lacks room), every rank of the
machine maps that file (`torch.from_file(shared=True)`: the same physical pages in every process) and uses views of
the mapping in place of its own copy, which it drops. Once all have mapped it, the file's name is removed: the pages
live as long as a mapping does and nothing is left behind when the processes end. The weights are frozen: no rank
writes them. On CUDA the mapping is page-locked (cudaHostRegister) as block swap's own copies were pinned, so the
copies to the device stay asynchronous.

Every rank must call `share_on_machine` with the same tensors (same shapes and dtypes) in the same order: it is a
collective (two barriers and one broadcast).
"""
from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

import torch

from modules.util.pinned_arena import layout, page_lock, views
from modules.util.ranks import barrier, broadcast_json

PREFIX = "wan-trainer-host-"


def _folder(size: int) -> Path:
    shm = Path("/dev/shm")
    if shm.is_dir():
        stats = os.statvfs(shm)
        if stats.f_bavail * stats.f_frsize >= size:
            return shm
    return Path(tempfile.gettempdir())   # a file-backed mapping still shares its pages between the processes


def share_on_machine(tensors: list[torch.Tensor], tag: str, device: torch.device) -> list[torch.Tensor]:
    """Views of one shared mapping per machine holding `tensors` (host tensors; the same on every rank)."""
    token = broadcast_json(uuid.uuid4().hex)
    offsets, size = layout(tensors)
    # every rank of the machine looks at the folder's room before the first one writes: they choose alike
    folder = _folder(size)
    barrier()
    path = folder / f"{PREFIX}{token}-{tag}"
    leader = int(os.environ.get("LOCAL_RANK", "0")) == 0
    if leader:
        with open(path, "wb") as file:
            file.truncate(size)
        mapping = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        for tensor, offset in zip(tensors, offsets):
            nbytes = tensor.numel() * tensor.element_size()
            mapping[offset:offset + nbytes].copy_(tensor.detach().to("cpu").reshape(-1).view(torch.uint8))
    barrier()
    if not leader:
        mapping = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
    barrier()
    if leader:
        path.unlink()
    if device.type == "cuda":   # each process registers its own mapping; a refusal leaves it pageable (a warning)
        page_lock(mapping)
    return views(mapping, tensors, offsets)


def share_swapped_blocks(setup, experts: list[str], device: torch.device) -> int:
    """The swapped blocks' host weights of `experts` shared by this machine's ranks; returns the bytes shared."""
    shared = 0
    for name in experts:
        performance = getattr(setup, "performance", {}).get(name)
        swap = performance.block_swap if performance is not None else None
        if swap is not None:
            shared += swap.replace_host_tensors(lambda tensors, name=name: share_on_machine(tensors, name, device))
    return shared
