"""A Wan block's self-attention without its output projection, so that the projection (a per-token part) can run
in token chunks with the rest of the block (ChunkedFeedForward).

The steps are diffusers' WanAttnProcessor (0.42) for self-attention (no encoder states, no image context): the
q/k/v projections, the q/k RMS norms, the rotary embedding, the attention kernel through diffusers' dispatcher
with the backend and parallel config the processor was given. The output is returned as the kernel gives it,
(batch, tokens, heads, head_dim), not flattened: flattening the kernel's strided output makes a copy, which the
chunks make one chunk at a time instead.
"""
from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_wan import WanAttnProcessor, _get_qkv_projections


def splittable(attn: torch.nn.Module) -> bool:
    """The attention runs diffusers' own processor (another one is called as it is, unchunked)."""
    return type(getattr(attn, "processor", None)) is WanAttnProcessor and getattr(attn, "add_k_proj", None) is None


def _apply_rotary_emb(hidden_states: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    # diffusers' WanAttnProcessor.__call__.apply_rotary_emb (a closure there, not importable)
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


def projections(attn: torch.nn.Module, hidden_states: torch.Tensor, rotary_emb) -> tuple[torch.Tensor, ...]:
    """(batch, tokens, width) -> the kernel's query, key and value, each (batch, tokens, heads, head_dim): per token
    (the rotary embedding's cos / sin are (1, tokens, 1, head_dim))."""
    query, key, value = _get_qkv_projections(attn, hidden_states, None)
    query = attn.norm_q(query)
    key = attn.norm_k(key)
    query = query.unflatten(2, (attn.heads, -1))
    key = key.unflatten(2, (attn.heads, -1))
    value = value.unflatten(2, (attn.heads, -1))
    if rotary_emb is not None:
        query = _apply_rotary_emb(query, *rotary_emb)
        key = _apply_rotary_emb(key, *rotary_emb)
    return query, key, value


def attention_kernel(attn: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
    """The only step of the block that mixes tokens: the output is (batch, tokens, heads, head_dim) in the dtype of
    the queries."""
    processor = attn.processor
    output = dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                   backend=processor._attention_backend, parallel_config=processor._parallel_config)
    return output.type_as(query)


def self_attention_core(attn: torch.nn.Module, hidden_states: torch.Tensor, rotary_emb) -> torch.Tensor:
    """(batch, tokens, width) -> the attention kernel's output (batch, tokens, heads, head_dim); `attn.to_out` of its
    flattened last two dims is diffusers' `attn(hidden_states, None, None, rotary_emb)`."""
    return attention_kernel(attn, *projections(attn, hidden_states, rotary_emb))


def output_projection(attn: torch.nn.Module, core_output: torch.Tensor) -> torch.Tensor:
    """The processor's last steps on (some tokens of) the kernel's output: (batch, tokens, heads, head_dim) ->
    (batch, tokens, width)."""
    return attn.to_out[1](attn.to_out[0](core_output.flatten(2, 3)))
