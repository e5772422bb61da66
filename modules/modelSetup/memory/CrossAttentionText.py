"""A Wan block's cross-attention in two parts, so that its keys and values of the text (and of I2V's image context)
are projected once per block while its queries run in token chunks (ChunkedFeedForward).

Each query token attends the same text on its own, so the keys and values do not depend on the chunk: projecting
them in every chunk repeated the same matrix products (and, in the planner's fake-tensor trace of a 14B step, the
same few hundred operations per chunk of 40 blocks). The steps are diffusers' WanAttnProcessor (0.42) for
cross-attention, in its order: I2V's image context split off the front of the encoder states, the k/v projections
(fused or not) and the key's RMS norm, then per chunk the query projection and its norm, the image and text
attention and the output projection. The forward pass is the same computation; the projections' weight gradients
are one sum over the chunks' key / value gradients instead of a sum of per-chunk products (equal within float32
rounding, as the chunks' other weight gradients).
"""
from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_wan import WanAttnProcessor, _get_added_kv_projections

TEXT_TOKENS = 512   # the text encoder's context length, hard-coded in diffusers' processor as well


def splittable(attn: torch.nn.Module) -> bool:
    """The cross-attention runs diffusers' own processor (another one is called whole in every chunk)."""
    return type(getattr(attn, "processor", None)) is WanAttnProcessor


def keys_values(attn: torch.nn.Module, encoder_hidden_states: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """(batch, [image tokens +] 512, width) -> the text's key and value and the image context's (None without
    one), each (batch, context tokens, heads, head_dim)."""
    image_states = None
    if attn.add_k_proj is not None:
        image_states = encoder_hidden_states[:, :encoder_hidden_states.shape[1] - TEXT_TOKENS]
        encoder_hidden_states = encoder_hidden_states[:, encoder_hidden_states.shape[1] - TEXT_TOKENS:]
    if attn.fused_projections:
        key, value = attn.to_kv(encoder_hidden_states).chunk(2, dim=-1)
    else:
        key, value = attn.to_k(encoder_hidden_states), attn.to_v(encoder_hidden_states)
    key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
    value = value.unflatten(2, (attn.heads, -1))
    if image_states is None:
        return key, value, None, None
    key_img, value_img = _get_added_kv_projections(attn, image_states)
    key_img = attn.norm_added_k(key_img).unflatten(2, (attn.heads, -1))
    return key, value, key_img, value_img.unflatten(2, (attn.heads, -1))


def _attend(attn: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    # (batch, tokens, heads, head_dim) -> (batch, tokens, width); the context is not split across ranks
    output = dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                   backend=attn.processor._attention_backend, parallel_config=None)
    return output.flatten(2, 3).type_as(query)


def cross_attention(attn: torch.nn.Module, hidden_states: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    key_img: torch.Tensor | None, value_img: torch.Tensor | None) -> torch.Tensor:
    """(batch, tokens, width) of some query tokens -> the cross-attention's output for them, with `keys_values`'
    tensors: diffusers' `attn(hidden_states, encoder_hidden_states, None, None)` for those tokens."""
    query = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))
    image_output = None if key_img is None else _attend(attn, query, key_img, value_img)
    output = _attend(attn, query, key, value)
    if image_output is not None:
        output = output + image_output
    return attn.to_out[1](attn.to_out[0](output))
