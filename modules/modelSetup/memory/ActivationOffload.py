"""Activation offload: the input of each checkpointed transformer block (the only activation a checkpointed block
keeps for the backward pass) is copied to CPU memory (pinned on CUDA) in the forward pass and copied back when the
backward pass recomputes that block.

It is a `torch.autograd.graph.saved_tensors_hooks` pair around the checkpoint call: torch's non-reentrant
checkpoint saves the block's inputs through the hooks in force, so `pack` sees the hidden states (and the text
embeddings, rope tables and timestep projections every block shares; those are left alone: one copy serves all
blocks). On CUDA both copies run on a side stream: the device-to-host copy overlaps the next blocks' compute, and
in the backward pass unpacking block k's input starts the copy of block k-1's, so it arrives while block k's
backward runs. On the CPU the same code makes plain copies (tests).

The host copies come from a `PinnedPool` (modules/util/pinned_arena.py): buffers of the exact size, page-locked
once on CUDA and reused by every step, where `pin_memory=True` per input took PyTorch's caching host allocator's
power-of-two blocks (a 14B block input of 336 MB took 512 MB, 40 of them 20 GiB for 13). A buffer goes back to
the pool when the saved tensor it holds is dropped (after the backward pass, or with a graph never run backward);
its reuse is a copy on the same side stream, so it never overwrites an input still being copied back. On the CPU
the plain copies stay unless `pooled=True` asks for the pool (without the registration, which needs CUDA).
"""
from __future__ import annotations

import contextlib
import weakref

import torch

from modules.util.pinned_arena import PinnedPool


class _Offloaded:
    __slots__ = ("host", "device", "event", "fetched", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, event):
        self.host, self.device, self.event = host, device, event
        self.fetched: tuple[torch.Tensor, object] | None = None


class ActivationOffload:
    def __init__(self, device: torch.device, pooled: bool | None = None):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.pool = PinnedPool(pin=self.cuda) if (self.cuda if pooled is None else pooled) else None
        self.order: list[_Offloaded] = []   # this forward pass's offloaded inputs, in forward order
        self.bytes_offloaded = 0

    def release_host_buffers(self) -> None:
        """Frees the pool's buffers between steps (the next step makes them again, the same values either way)."""
        if self.pool is not None:
            self.pool.clear()

    @contextlib.contextmanager
    def saving(self, hidden_states: torch.Tensor):
        """Within this context, a saved tensor that is `hidden_states` (same memory and shape) goes to the host."""
        pointer, shape = hidden_states.data_ptr(), hidden_states.shape

        def pack(tensor: torch.Tensor):
            if tensor.data_ptr() != pointer or tensor.shape != shape or tensor.device != self.device:
                return tensor
            return self._offload(tensor)

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    def _offload(self, tensor: torch.Tensor) -> _Offloaded:
        buffer = None
        if self.pool is not None:
            buffer = self.pool.take(tensor.numel() * tensor.element_size())
            host = self.pool.tensor(buffer, tensor.shape, tensor.dtype)
        if not self.cuda:
            if buffer is None:
                host = tensor.detach().to("cpu", copy=True)
            else:
                host.copy_(tensor.detach())
            packed = _Offloaded(host, self.device, None)
        else:
            if buffer is None:
                host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                host.copy_(tensor.detach(), non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            tensor.record_stream(self.stream)  # its memory is not reused before the copy has read it
            packed = _Offloaded(host, self.device, event)
        if buffer is not None:   # back to the pool once nothing can read this copy again
            weakref.finalize(packed, self.pool.give, buffer)
        self.bytes_offloaded += tensor.numel() * tensor.element_size()
        self.order.append(packed)
        return packed

    def _fetch(self, packed: _Offloaded) -> None:
        if packed.fetched is not None:
            return
        if not self.cuda:
            packed.fetched = (packed.host.to(self.device, copy=True), None)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            tensor = packed.host.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        packed.fetched = (tensor, event)

    def _unpack(self, packed):
        if not isinstance(packed, _Offloaded):
            return packed
        self._fetch(packed)
        tensor, event = packed.fetched
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            tensor.record_stream(current)
        # the backward pass runs blocks in reverse: start bringing back the input of the block before this one
        if packed in self.order:
            position = self.order.index(packed)
            if position > 0:
                self._fetch(self.order[position - 1])
            del self.order[position:]
        packed.fetched = None
        return tensor
