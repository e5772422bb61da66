"""Per-block gradient checkpointing with a dial: the function diffusers' WanTransformer3DModel calls for every block
when its gradient checkpointing is on (`enable_gradient_checkpointing(gradient_checkpointing_func=...)`).

A block is checkpointed when its index is a multiple of `every` (1: every block; 0: none) or when it is swapped
(BlockSwap needs it); the others run plainly and keep their activations. Checkpointed blocks use torch's
non-reentrant checkpoint, optionally with their input offloaded to the host (ActivationOffload). Blocks the model
checkpoints outside its main list (VACE's `vace_blocks`) are always checkpointed, their inputs kept on the device.
"""
from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from modules.modelSetup.memory.ActivationOffload import ActivationOffload


class _State(threading.local):
    checkpointed = False   # a checkpointed block is running (its forward pass or its recomputation)
    recomputing = False    # ... its recomputation for the backward pass


_state = _State()


def checkpoint_state() -> _State:
    """What the running block is inside (ChunkedFeedForward skips work a recomputation would throw away)."""
    return _state


@contextlib.contextmanager
def _inside(recomputing: bool):
    kept = _state.checkpointed, _state.recomputing
    _state.checkpointed, _state.recomputing = True, recomputing
    try:
        yield
    finally:
        _state.checkpointed, _state.recomputing = kept


def _contexts():
    return _inside(False), _inside(True)


class BlockCheckpointing:
    def __init__(self, blocks: nn.ModuleList, every: int, always: set[int] | None = None,
                 offload: ActivationOffload | None = None):
        self.position = {id(block): index for index, block in enumerate(blocks)}
        self.every = every
        self.always = always or set()
        self.offload = offload

    def checkpointed(self, index: int) -> bool:
        return index in self.always or (self.every > 0 and index % self.every == 0)

    def __call__(self, block: nn.Module, *args, **kwargs):
        # keyword arguments: Animate-2's blocks take theirs so (the KV cache, the pass)
        index = self.position.get(id(block))
        if index is None:   # a block outside the main list (VACE's blocks, never swapped): always checkpointed
            return checkpoint(block, *args, use_reentrant=False, **kwargs)
        if not self.checkpointed(index):
            return block(*args, **kwargs)
        saving = self.offload.saving(args[0]) if self.offload is not None else contextlib.nullcontext()
        # torch stops a recomputation as soon as it has what the backward pass needs (a swapped block stays on the
        # device until its backward pass is done: BlockSwap)
        with saving:
            return checkpoint(block, *args, use_reentrant=False, context_fn=_contexts, **kwargs)
