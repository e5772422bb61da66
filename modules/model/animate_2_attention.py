"""Wan2.2-Animate-2's generation self-attention with gradients on any device (DESIGN.md section 11).

diffusers' `WanAnimate2AttnProcessor` (models/transformers/transformer_wan_animate_2.py) runs the cached pass through
a flex `BlockMask`: each generation token attends to every generation token, and generation frame f (f >= 1; frame 0
is the reference slot) also to the cached driving-video tokens of driving latent frame f - 1. torch's flex attention
has no backward on the CPU, and on a GPU it needs torch.compile, so a training step cannot use it as it is. This
processor computes the same attention: the extract pass exactly as diffusers' (it is diffusers' code), the cached pass
as one attention over [generation | driving] keys under that mask: compiled flex attention on CUDA (memory linear in
the sequence), a dense boolean mask elsewhere (the tiny models of the tests). The result equals diffusers' packed
flex attention (its 128-token padding only adds masked keys and dropped queries).
"""
import functools

import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_wan_animate_2 import (WanAnimate2AttnProcessor, _get_qkv_projections,
                                                                     rope_apply)


def in_context_allowed(query_frames: int, reference_frames: int, tokens_per_frame: int, device=None) -> torch.Tensor:
    """(Lq, Lq + Lr) bool: which keys each generation query attends (Lq = query_frames x tokens_per_frame)."""
    hw = tokens_per_frame
    query_frame = torch.arange(query_frames * hw, device=device) // hw
    reference_frame = torch.arange(reference_frames * hw, device=device) // hw + 1
    generation = torch.ones(query_frame.numel(), query_frame.numel(), dtype=torch.bool, device=device)
    return torch.cat([generation, query_frame[:, None] == reference_frame[None, :]], dim=1)


@functools.lru_cache(maxsize=8)
def _block_mask(query_frames: int, reference_frames: int, hw: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask
    limit = query_frames * hw

    def allowed(_b, _h, q, kv):
        return (kv < limit) | ((q // hw) == ((kv - limit) // hw + 1))
    return create_block_mask(allowed, None, None, limit, limit + reference_frames * hw, device=device)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


def in_context_attention(query, key, value, query_frames: int, reference_frames: int, hw: int) -> torch.Tensor:
    """query (B, H, Lq, D); key, value (B, H, Lq + Lr, D): generation then driving tokens -> (B, H, Lq, D)."""
    if query.device.type == "cuda":
        mask = _block_mask(query_frames, reference_frames, hw, str(query.device))
        return _compiled_flex()(query, key, value, block_mask=mask)
    from torch._subclasses.fake_tensor import is_fake
    if is_fake(query):
        # the memory planner (modules/planner/step_trace.py): flex attention keeps what a fused attention over the
        # same keys keeps (its inputs, output and log-sum-exp), never a mask or a score matrix
        return F.scaled_dot_product_attention(query, key, value)
    allowed = in_context_allowed(query_frames, reference_frames, hw, query.device)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=allowed)


class WanAnimate2TrainingAttnProcessor(WanAnimate2AttnProcessor):
    """diffusers' processor, its cached pass through `in_context_attention` (the extract pass is diffusers')."""

    def __call__(self, attn, hidden_states, rotary_emb, grid_sizes, kv_cache, kv_cache_mode, rope_stride=1,
                 reference_rotary_emb=None, reference_grid_sizes=None, reference_rope_stride=1, attention_mask=None,
                 origin_latent_frames=None, origin_latent_hw=None):
        if kv_cache_mode != "cached":
            return super().__call__(attn, hidden_states, rotary_emb, grid_sizes, kv_cache, kv_cache_mode,
                                    rope_stride, reference_rotary_emb, reference_grid_sizes, reference_rope_stride,
                                    attention_mask, origin_latent_frames, origin_latent_hw)
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query, key = attn.norm_q(query), attn.norm_k(key)
        # (B, L, H * D) -> (B, L, H, D)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        query = rope_apply(query, grid_sizes, rotary_emb, rope_stride).type_as(value)
        key = rope_apply(key, grid_sizes, rotary_emb, rope_stride).type_as(value)
        key_reference, value_reference = kv_cache.get()
        key_reference = rope_apply(key_reference, reference_grid_sizes, reference_rotary_emb,
                                   reference_rope_stride).type_as(value)
        frames, height, width = grid_sizes[0].tolist()
        reference_frames = int(reference_grid_sizes[0][0])
        if (height, width) != tuple(reference_grid_sizes[0][1:].tolist()):
            raise ValueError(f"the driving video's latent grid {reference_grid_sizes[0].tolist()} is not the "
                             f"generated one's {grid_sizes[0].tolist()} in height and width")
        # (B, L, H, D) -> (B, H, L, D)
        out = in_context_attention(query.transpose(1, 2), torch.cat([key, key_reference], 1).transpose(1, 2),
                                   torch.cat([value, value_reference.type_as(value)], 1).transpose(1, 2),
                                   frames, reference_frames, height * width)
        out = out.transpose(1, 2).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def _no_block_mask(*_args):
    return None


def use_training_attention(transformer) -> int:
    """Sets the training processor on every block's self-attention; returns how many. The processor masks by its own
    `in_context_attention`, so the model no longer builds (and compiles) the flex `BlockMask` it would pass it."""
    blocks = [block for block in transformer.blocks if hasattr(block, "self_attn")]
    for block in blocks:
        block.self_attn.set_processor(WanAnimate2TrainingAttnProcessor())
    transformer.create_mask = _no_block_mask
    return len(blocks)
