"""Applies `TrainConfig.performance` (and `gradient_checkpointing`) to one transformer being trained: the attention
kernel, block swap, per-block checkpointing with optional activation offload, recomputed norms, and regional
compilation, and moves the transformer to the device without ever holding the swapped blocks there.

Order matters: block swap moves the swapped weights to the host before anything is placed on the device, the
checkpointing function must know which blocks are swapped, and compilation leaves the swapped blocks alone (their
hooks move weights, which a compiled graph cannot contain).
"""
from __future__ import annotations

import logging

import torch

from modules.modelSetup.memory.ActivationOffload import ActivationOffload
from modules.modelSetup.memory.BlockCheckpointing import BlockCheckpointing
from modules.modelSetup.memory.FaceAdapterCheckpointing import checkpoint_face_adapter
from modules.modelSetup.memory.Float8Upcast import upcast_float8_in_backward
from modules.modelSetup.memory.BlockSwap import BlockSwap
from modules.modelSetup.memory.ChunkedFeedForward import chunk_feed_forward
from modules.modelSetup.memory.NormRecompute import recompute_norms
from modules.util.config.PerformanceConfig import PerformanceConfig

log = logging.getLogger(__name__)

# performance.attention -> diffusers' attention dispatcher backend (each one a torch SDPA kernel)
ATTENTION_BACKENDS = {"flash": "_native_flash", "cudnn": "_native_cudnn", "efficient": "_native_efficient",
                      "math": "_native_math"}


class PerformanceSetup:
    def __init__(self, transformer: torch.nn.Module, performance: PerformanceConfig, gradient_checkpointing: bool,
                 device: torch.device, fine_tune: bool = False, compile_backend: str = "inductor"):
        """`fine_tune`: the transformer's own weights train, so the swapped blocks must be frozen."""
        self.transformer = transformer
        self.performance = performance
        self.gradient_checkpointing = gradient_checkpointing
        self.device = torch.device(device)
        self.fine_tune = fine_tune
        self.compile_backend = compile_backend
        self.block_swap: BlockSwap | None = None
        self.offload: ActivationOffload | None = None
        self.checkpointing: BlockCheckpointing | None = None
        self.compiled: list[int] = []
        self.norms_recomputed = 0
        self.chunked_blocks: list = []   # ChunkedFeedForward hooks
        self.float8_layers = 0   # FLOAT_8 layers whose bfloat16 weight is made again in the backward pass

    def apply(self) -> PerformanceSetup:
        performance, transformer = self.performance, self.transformer
        blocks = transformer.blocks
        if performance.attention != "auto":
            from diffusers.models.attention_dispatch import _AttentionBackendRegistry
            default = _AttentionBackendRegistry._active_backend
            transformer.set_attention_backend(ATTENTION_BACKENDS[performance.attention])
            # diffusers also makes the backend the process-wide default; only this transformer asked for it (the
            # benchmark's baseline, a second expert and the sampler's other models keep theirs)
            _AttentionBackendRegistry.set_active_backend(default)
        if performance.block_swap:
            self.block_swap = BlockSwap(blocks, performance.block_swap, self.device)
            if self.fine_tune:
                self.block_swap.check_frozen()
        if performance.activation_offload and self.gradient_checkpointing:
            self.offload = ActivationOffload(self.device)
            # a forward pass that never reached its backward pass (an exception) must not keep its host copies
            transformer.register_forward_pre_hook(lambda *_: self.offload.order.clear())
        swapped = set(self.block_swap.indices) if self.block_swap else set()
        if self.gradient_checkpointing or swapped:
            self.checkpointing = BlockCheckpointing(blocks, performance.checkpoint_every if
                                                    self.gradient_checkpointing else 0, swapped, self.offload)
            transformer.enable_gradient_checkpointing(gradient_checkpointing_func=self.checkpointing)
            if self.gradient_checkpointing:
                checkpoint_face_adapter(transformer)   # Animate: its adapter blocks run between the blocks
        elif getattr(transformer, "gradient_checkpointing", False):
            transformer.disable_gradient_checkpointing()
        # compiled blocks are left alone (as below): the compiler chooses what a block keeps; the chunking hook
        # goes on before the norms' hooks, which then wrap it
        plain = [b for i, b in enumerate(blocks) if i in swapped or not performance.compile_blocks]
        if performance.chunk_tokens:
            # the chunking follows diffusers' WanTransformerBlock forward line by line (Animate's blocks are copies
            # of it); Animate-2's blocks (self_attn / cross_attn, another signature) run whole
            chunkable = [block for block in plain if hasattr(block, "attn1")]
            self.chunked_blocks = chunk_feed_forward(chunkable, performance.chunk_tokens,
                                                     performance.chunk_attention_inputs)
        if performance.recompute_norms:
            # a compiled block is left alone: the compiler picks what it keeps itself, and a hook that records
            # the block's dtype would only break its graph
            self.norms_recomputed = recompute_norms(plain, performance.chunk_tokens)
        # a compiled block is left alone here too: the compiler decides what its graph saves
        self.float8_layers = upcast_float8_in_backward(transformer, skip=tuple(
            b for i, b in enumerate(blocks) if i not in swapped and performance.compile_blocks))
        if performance.compile_blocks:
            for index, block in enumerate(blocks):
                if index not in swapped:
                    block.compile(backend=self.compile_backend, dynamic=False)
                    self.compiled.append(index)
        return self

    def move_to_device(self) -> None:
        if self.block_swap is not None:
            self.block_swap.move_to_device(self.transformer)
        else:
            self.transformer.to(self.device)

    def release_host_buffers(self) -> None:
        """Activation offload's host buffers freed (made again by the next step): they are the largest host
        memory a step leaves, and a backup or the final save needs the room, not them."""
        if self.offload is not None:
            self.offload.release_host_buffers()

    def describe(self) -> str:
        parts = []
        if self.checkpointing is not None:
            count = sum(self.checkpointing.checkpointed(i) for i in range(len(self.transformer.blocks)))
            parts.append(f"checkpointing {count}/{len(self.transformer.blocks)} blocks")
        if self.block_swap is not None:
            parts.append(f"block swap {len(self.block_swap.indices)} (blocks {self.block_swap.indices[0]}-"
                         f"{self.block_swap.indices[-1]})")
        if self.offload is not None:
            parts.append("activation offload")
        if self.performance.attention != "auto":
            parts.append(f"attention {self.performance.attention}")
        if self.norms_recomputed:
            parts.append("norms recomputed")
        if self.chunked_blocks:
            parts.append(f"per-token parts in chunks of {self.performance.chunk_tokens} tokens"
                         + (" (attention inputs too)" if self.performance.chunk_attention_inputs else ""))
        if self.compiled:
            parts.append(f"{len(self.compiled)} blocks compiled")
        return ", ".join(parts) or "no memory features"
