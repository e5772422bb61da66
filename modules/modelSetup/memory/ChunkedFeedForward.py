"""The transformer block's feed-forward part in token chunks (`performance.chunk_tokens`, which also chunks the
recomputed norms: NormRecompute).

The feed-forward's hidden state is the widest tensor of a Wan block (8,960 wide for the 1.3B, 13,824 for the 14B,
against 1,536 / 5,120 for the residual stream): at 32,760 tokens one of them is 561 MiB (1.3B, bf16), and the
backward pass of a recomputed block holds four at once (the LoRA-wrapped up projection's `result + lora_B(...)`,
the down projection's input gradient from its base layer and from its adapter, and their sum). Here the third part
of the block, `h + ffn(norm3(h) * (1 + scale) + shift) * gate`, runs on `chunk_tokens` tokens at a time,
each chunk under its own (nested) non-reentrant checkpoint: the block keeps only the chunk inputs it already has,
and the backward pass recomputes one chunk's feed-forward at a time. peft's wrapped linears (LoRA, DoRA, LoHa,
LoKr) run inside the chunk as they are.

It costs no extra compute inside a checkpointed block: when the backward pass recomputes the block, the chunks are
not computed (their outputs would be thrown away: nothing after them in the block keeps a tensor, and torch stops
the recomputation as soon as the last chunk's inputs are saved), and each chunk's own recomputation is then the
one forward pass of the feed-forward the block's recomputation would have made. A block that is not checkpointed
runs its chunks plainly (the same numbers, no saving of its kept activations, a smaller backward transient).

The numbers: every token's forward is the same computation (norms and activations are per token); a matrix
product over fewer rows may take another kernel path, and the weight gradients are sums over the chunks instead
of one sum over all tokens, so the result is equal within float32 rounding (tested), not bit for bit.

The rest of the block is diffusers' WanTransformerBlock.forward (0.42) as written, the hook (diffusers' own
`ModelHook`) replaces the forward only, so module names and state dicts stay as they are.
"""
from __future__ import annotations

import torch
from diffusers.hooks import HookRegistry, ModelHook
from torch.utils.checkpoint import checkpoint

from modules.modelSetup.memory.BlockCheckpointing import checkpoint_state
from modules.modelSetup.memory.NormRecompute import float_norm

HOOK = "chunked_feed_forward"


def _feed_forward_part(block, hidden_states, shift, scale, gate):
    """diffusers' `3. Feed-forward` of WanTransformerBlock on some tokens: returns the block's output for them."""
    norm_hidden_states = (float_norm(block.norm3, hidden_states) * (1 + scale) + shift).type_as(hidden_states)
    ff_output = block.ffn(norm_hidden_states)
    return (hidden_states.float() + ff_output.float() * gate).type_as(hidden_states)


def _not_computed(_block, hidden_states, *_modulation):
    # the block is being recomputed for its backward pass: this chunk's output is thrown away (see module doc)
    return torch.empty_like(hidden_states)


class ChunkedFeedForward(ModelHook):
    def __init__(self, chunk_tokens: int):
        super().__init__()
        self.chunk_tokens = chunk_tokens
        self.chunks_run = 0   # chunk forwards computed (tests: a recomputed block computes none)

    def new_forward(self, block, hidden_states, encoder_hidden_states, temb, rotary_emb):
        if temb.ndim == 4:
            # temb: batch_size, seq_len, 6, inner_dim (wan2.2 ti2v)
            shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
                block.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)
            shift_msa, scale_msa, gate_msa = shift_msa.squeeze(2), scale_msa.squeeze(2), gate_msa.squeeze(2)
            c_shift_msa, c_scale_msa, c_gate_msa = c_shift_msa.squeeze(2), c_scale_msa.squeeze(2), c_gate_msa.squeeze(2)
        else:
            # temb: batch_size, 6, inner_dim (wan2.1/wan2.2 14B)
            shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = (
                block.scale_shift_table + temb.float()).chunk(6, dim=1)

        # 1. Self-attention
        norm_hidden_states = (float_norm(block.norm1, hidden_states) * (1 + scale_msa) + shift_msa).type_as(
            hidden_states)
        attn_output = block.attn1(norm_hidden_states, None, None, rotary_emb)
        hidden_states = (hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)

        # 2. Cross-attention
        norm_hidden_states = float_norm(block.norm2, hidden_states).type_as(hidden_states)
        attn_output = block.attn2(norm_hidden_states, encoder_hidden_states, None, None)
        hidden_states = hidden_states + attn_output

        # 3. Feed-forward, in chunks of tokens (dim 1 of (batch, tokens, width))
        return self._chunked(block, hidden_states, c_shift_msa, c_scale_msa, c_gate_msa)

    def _chunked(self, block, hidden_states, *modulation):
        tokens = hidden_states.shape[1]
        if tokens <= self.chunk_tokens:
            self.chunks_run += 1
            return _feed_forward_part(block, hidden_states, *modulation)
        state = checkpoint_state()
        nested = state.checkpointed and torch.is_grad_enabled()
        part = _not_computed if state.recomputing else _feed_forward_part
        outputs = []
        for start in range(0, tokens, self.chunk_tokens):
            end = min(start + self.chunk_tokens, tokens)
            # TI2V-5B's modulation is per token (batch, tokens, width): sliced with the tokens
            chunk = [hidden_states[:, start:end]] + [m[:, start:end] if m.shape[1] == tokens else m
                                                     for m in modulation]
            if part is _feed_forward_part:
                self.chunks_run += 1
            if nested:
                outputs.append(checkpoint(part, block, *chunk, use_reentrant=False))
            else:
                outputs.append(part(block, *chunk))
        return torch.cat(outputs, dim=1)


def chunk_feed_forward(blocks, chunk_tokens: int) -> list[ChunkedFeedForward]:
    """Hooks each given block (before any other hook on it, so theirs still wrap the block); returns the hooks."""
    hooks = []
    for block in blocks:
        registry = HookRegistry.check_if_exists_or_initialize(block)
        hook = registry.get_hook(HOOK)
        if hook is None:
            hook = ChunkedFeedForward(chunk_tokens)
            registry.register_hook(hook, HOOK)
        hook.chunk_tokens = chunk_tokens
        hooks.append(hook)
    return hooks
