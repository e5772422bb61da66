"""Norms recomputed in the backward pass from their narrow input (`performance.recompute_norms`).

diffusers' WanTransformerBlock (0.42) keeps its residual stream in the training dtype (bf16 under autocast) but
runs every norm in float32: `norm1/norm2/norm3(hidden_states.float())` (FP32LayerNorm) and the RMS norms of the
attention's queries and keys (torch.nn.RMSNorm, whose kernel upcasts a bf16 input to float32). Autograd keeps each
of those float32 copies for the backward pass: six per block, 192 MiB each for Wan 1.3B at 832x480x81, the largest part of what a
recomputed block holds after its feed-forward's. Here each norm runs under its own (nested) non-reentrant
checkpoint that keeps only the narrow tensor the float32 copy was made from, and the backward pass makes the copy
again. The numbers are the same bit for bit (the float32 copy of a bf16 tensor is exact, and the norm recomputes
from the same values with the same kernel); the cost is each norm's forward once more in the backward pass, a
few elementwise passes over the block's activations (no matmul).

The layer norms' float32 input is made by the block, outside the norm, so its narrow source is not at hand: the
norm narrows it back to the dtype of the block's input, which is exact because the block made it with
`.float()` from a tensor of that dtype (recorded by a hook on the block). With a float32 residual stream (float32
training) nothing is narrowed and the norms run as they are.

The hooks are diffusers' own (`diffusers.hooks.ModelHook`, as layerwise casting replaces a forward), so the
modules, their names and their state dicts stay as they are.
"""
from __future__ import annotations

import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models.normalization import FP32LayerNorm
from torch.utils.checkpoint import checkpoint

HOOK = "recompute_norms"
LAYER_NORMS = ("norm1", "norm2", "norm3")
RMS_NORMS = ("norm_q", "norm_k", "norm_added_k")


class _BlockDtype(ModelHook):
    """Remembers the dtype of the block's hidden states: the dtype its float32 norm inputs were made from."""

    def __init__(self):
        super().__init__()
        self.dtype: torch.dtype | None = None

    def pre_forward(self, module, *args, **kwargs):
        hidden_states = args[0] if args else kwargs.get("hidden_states")
        self.dtype = hidden_states.dtype if isinstance(hidden_states, torch.Tensor) else None
        return args, kwargs


def _recompute(forward, tensor: torch.Tensor, chunk_tokens: int = 0):
    """`chunk_tokens`: the norm (per token) runs on that many tokens (dim 1) at a time, each chunk under its own
    checkpoint, so its backward pass's float32 temporaries exist for one chunk only."""
    # norms draw no random numbers: no generator state to stash and restore for the recomputation
    if not chunk_tokens or tensor.dim() < 3 or tensor.shape[1] <= chunk_tokens:
        return checkpoint(forward, tensor, use_reentrant=False, preserve_rng_state=False)
    return torch.cat([checkpoint(forward, chunk, use_reentrant=False, preserve_rng_state=False)
                      for chunk in tensor.split(chunk_tokens, dim=1)], dim=1)


class _RecomputedLayerNorm(ModelHook):
    def __init__(self, block: _BlockDtype, chunk_tokens: int = 0):
        super().__init__()
        self.block = block
        self.chunk_tokens = chunk_tokens

    def new_forward(self, module, inputs, *args, **kwargs):
        narrow = self.block.dtype
        if args or kwargs or not torch.is_grad_enabled() or inputs.dtype != torch.float32 \
                or narrow in (None, torch.float32):
            return self.fn_ref.original_forward(inputs, *args, **kwargs)
        original = self.fn_ref.original_forward
        return _recompute(lambda kept: original(kept.float()), inputs.to(narrow), self.chunk_tokens)


class _RecomputedRMSNorm(ModelHook):
    def __init__(self, chunk_tokens: int = 0):
        super().__init__()
        self.chunk_tokens = chunk_tokens

    def new_forward(self, module, hidden_states, *args, **kwargs):
        if args or kwargs or not torch.is_grad_enabled() or hidden_states.dtype == torch.float32:
            return self.fn_ref.original_forward(hidden_states, *args, **kwargs)
        return _recompute(self.fn_ref.original_forward, hidden_states, self.chunk_tokens)


def float_norm(norm: torch.nn.Module, narrow: torch.Tensor) -> torch.Tensor:
    """`norm(narrow.float())`, as diffusers' block calls its float32 layer norms; when the norm is recomputed, the
    checkpoint keeps `narrow` itself (which the block keeps anyway) instead of narrowing the float32 copy back into a
    new tensor (ChunkedFeedForward's block forward calls its norms through this)."""
    registry = getattr(norm, "_diffusers_hook", None)
    hook = registry.get_hook(HOOK) if registry is not None else None
    if not isinstance(hook, _RecomputedLayerNorm) or not torch.is_grad_enabled() or narrow.dtype == torch.float32:
        return norm(narrow.float())
    original = hook.fn_ref.original_forward
    return _recompute(lambda kept: original(kept.float()), narrow, hook.chunk_tokens)


def _hook(module: torch.nn.Module, hook: ModelHook) -> ModelHook:
    registry = HookRegistry.check_if_exists_or_initialize(module)
    if registry.get_hook(HOOK) is None:   # a transformer set up twice keeps one hook per module
        registry.register_hook(hook, HOOK)
    kept = registry.get_hook(HOOK)
    if hasattr(hook, "chunk_tokens"):
        kept.chunk_tokens = hook.chunk_tokens
    return kept


def recompute_norms(blocks, chunk_tokens: int = 0) -> int:
    """Hooks the norms of each given block (`chunk_tokens`: see _recompute); returns how many norms are hooked."""
    hooked = 0
    for block in blocks:
        dtype = _hook(block, _BlockDtype())
        for name in LAYER_NORMS:
            norm = getattr(block, name, None)
            if isinstance(norm, FP32LayerNorm):
                _hook(norm, _RecomputedLayerNorm(dtype, chunk_tokens))
                hooked += 1
        for attention in (getattr(block, "attn1", None), getattr(block, "attn2", None)):
            for name in RMS_NORMS:
                norm = getattr(attention, name, None)
                if isinstance(norm, torch.nn.RMSNorm):
                    _hook(norm, _RecomputedRMSNorm(chunk_tokens))
                    hooked += 1
    return hooked
