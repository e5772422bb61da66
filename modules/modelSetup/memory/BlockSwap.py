"""Block swap: the frozen weights of the last N transformer blocks live in CPU memory (pinned on CUDA) and are
copied to the device just before each of those blocks runs, in the forward pass and in the backward pass's
recomputation, then dropped again.

Contract:
- Only frozen parameters are swapped; trainable ones (LoRA adapters, a fine-tune's weights) stay on the device, so
  their gradients and optimizer state never move. A fine-tune must leave the swapped blocks frozen.
- A swapped block must be checkpointed (BlockCheckpointing does it): its forward then saves nothing for the backward
  pass, and the recomputation in the backward pass loads the weights again. Without checkpointing the autograd graph
  would hold the device copies until the backward pass and nothing would be saved.
- At most two swapped blocks are on the device at once: the one running and the next one, whose copy runs on a side
  CUDA stream while the current block computes (an event orders the compute stream after the copy). In the backward
  pass the next block is the previous one (blocks run in reverse), and a recomputed block stays on the device until
  its backward pass is done (the nested checkpoints inside it, ChunkedFeedForward's chunks and NormRecompute's
  norms, recompute after the block's recomputation has returned): the next block's load evicts it, and the end of
  the backward pass evicts the last one.
- The host copies are views into one allocation of the exact size (modules/util/pinned_arena.py), page-locked once
  with cudaHostRegister on CUDA and unregistered by `remove`: `pin_memory()` per tensor took each from PyTorch's
  caching host allocator rounded up to a power of two (a 14B transformer's 34 swapped blocks: 17 GiB for 11 GiB).
- On the CPU (tests) the same code runs without streams: the "device copy" is a plain copy of the host tensor, and
  the host copies stay the parameters' own tensors unless `arena=True` asks for the arena (without the
  registration, which needs CUDA).
- fp8 layerwise storage (diffusers' hooks on the Linear layers) composes: the host copy is the fp8 tensor, the
  layer hooks upcast the device copy to bf16 for compute.
"""
from __future__ import annotations

import torch
from torch import nn

from modules.util.pinned_arena import PinnedArena


class BlockSwap:
    def __init__(self, blocks: nn.ModuleList, count: int, device: torch.device, arena: bool | None = None):
        if not 0 < count <= len(blocks):
            raise ValueError(f"performance.block_swap: {count} is not between 1 and the transformer's "
                             f"{len(blocks)} blocks")
        self.blocks = blocks
        self.device = torch.device(device)
        self.indices = list(range(len(blocks) - count, len(blocks)))
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        # per swapped block: [(parameter, host tensor)]
        self.host: dict[int, list[tuple[nn.Parameter, torch.Tensor]]] = {}
        self.resident: set[int] = set()
        self.pending: dict[int, tuple[list[torch.Tensor], torch.cuda.Event | None]] = {}
        self.handles = []
        self._evicting_at_end = None   # the backward pass whose end evicts the last recomputed block
        frozen = {index: [p for p in blocks[index].parameters() if not p.requires_grad] for index in self.indices}
        self.arena: PinnedArena | None = None
        if self.cuda if arena is None else arena:
            flat = [p for index in self.indices for p in frozen[index]]
            self.arena = PinnedArena([p.data for p in flat])
            for parameter, view in zip(flat, self.arena.views):
                view.copy_(parameter.data)
                parameter.data = view   # its old tensor is freed now: the arena fills as the sources go
            if self.cuda:
                self.arena.lock()
        for index in self.indices:
            pairs = []
            for parameter in frozen[index]:
                host = parameter.data.to("cpu")
                parameter.data = host
                pairs.append((parameter, host))
            self.host[index] = pairs
            block = blocks[index]
            self.handles.append(block.register_forward_pre_hook(self._pre_hook(index)))
            self.handles.append(block.register_forward_hook(self._post_hook(index)))

    def swapped_parameters(self) -> set[int]:
        """ids of the parameters that stay on the host between uses."""
        return {id(parameter) for pairs in self.host.values() for parameter, _ in pairs}

    def replace_host_tensors(self, replace) -> int:
        """Swaps the host copies for `replace(host tensors)` (the same tensors, elsewhere: one copy shared by the
        ranks of a machine, modules/trainer/shared_host.py), in block order; returns their bytes."""
        flat = [host for index in self.indices for _, host in self.host[index]]
        replaced = iter(replace(flat))
        for index in self.indices:
            pairs = [(parameter, next(replaced)) for parameter, _ in self.host[index]]
            if index not in self.resident:
                for parameter, host in pairs:
                    parameter.data = host
            self.host[index] = pairs
        nbytes = sum(t.numel() * t.element_size() for t in flat)
        del flat
        self._release_arena()   # its views are no longer used: unregistered and freed
        return nbytes

    def _release_arena(self) -> None:
        if self.arena is not None:
            self.arena.release()
            self.arena = None

    def check_frozen(self) -> None:
        """For a fine-tune: raises when a swapped block trains (its weights would stay on the device, and the swap
        would quietly save nothing); a fine-tune with block swap trains the other blocks only."""
        for index in self.indices:
            trained = [name for name, p in self.blocks[index].named_parameters() if p.requires_grad]
            if trained:
                raise ValueError(f"performance.block_swap: block {index} is swapped but trains {trained[:3]}; swap "
                                 f"fewer blocks or train only blocks 0..{self.indices[0] - 1} "
                                 f"(fine_tune.layer_filter)")

    # ---- hooks ----------------------------------------------------------------------------------------------

    def _pre_hook(self, index: int):
        def hook(_module, _args):
            self._load(index)
            for other in list(self.resident - {index}):
                self._evict(other)  # left over when a recomputation stopped early (its post hook did not run)
            # the autograd engine runs the backward pass (and the recomputations) with a graph task id
            backward = torch._C._current_graph_task_id() != -1
            if backward and self._evicting_at_end != torch._C._current_graph_task_id():
                self._evicting_at_end = torch._C._current_graph_task_id()
                torch.autograd.Variable._execution_engine.queue_callback(self._evict_all)
            following = index - 1 if backward else index + 1
            if following in self.host and following not in self.resident:
                self._prefetch(following)
        return hook

    def _post_hook(self, index: int):
        def hook(_module, _args, _output):
            if torch._C._current_graph_task_id() == -1:   # a recomputation keeps it for the block's backward pass
                self._evict(index)
        return hook

    def _evict_all(self) -> None:
        for index in list(self.resident):
            self._evict(index)

    # ---- moves ----------------------------------------------------------------------------------------------

    def _copies(self, index: int) -> list[torch.Tensor]:
        if not self.cuda:
            return [host.to(self.device, copy=True) for _, host in self.host[index]]
        return [host.to(self.device, non_blocking=True) for _, host in self.host[index]]

    def _prefetch(self, index: int) -> None:
        if index in self.pending:
            return
        if not self.cuda:
            self.pending[index] = (self._copies(index), None)
            return
        # the copy may not start before the compute stream is done with the memory it reuses
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            copies = self._copies(index)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.pending[index] = (copies, event)

    def _load(self, index: int) -> None:
        if index in self.resident:
            return
        copies, event = self.pending.pop(index, None) or (self._copies(index), None)
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for tensor in copies:
                tensor.record_stream(current)  # allocated on the side stream, used on the compute stream
        for (parameter, _), tensor in zip(self.host[index], copies):
            parameter.data = tensor
        self.resident.add(index)

    def _evict(self, index: int) -> None:
        for parameter, host in self.host[index]:
            parameter.data = host
        self.resident.discard(index)

    def move_to_device(self, module: nn.Module) -> None:
        """Moves every parameter and buffer of `module` to the device except the swapped ones."""
        swapped = self.swapped_parameters()
        for parameter in module.parameters():
            if id(parameter) not in swapped:
                parameter.data = parameter.data.to(self.device)
        for sub in module.modules():
            for name, buffer in list(sub._buffers.items()):
                if buffer is not None:
                    sub._buffers[name] = buffer.to(self.device)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        for index in list(self.resident):
            self._evict(index)
        self.pending.clear()
        # the parameters keep their host views: the memory stays (pageable) as long as they do
        self._release_arena()
