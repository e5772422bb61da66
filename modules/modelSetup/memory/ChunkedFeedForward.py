"""The transformer block's per-token parts in token chunks (`performance.chunk_tokens`, which also chunks the
recomputed norms: NormRecompute).

Only the self-attention's kernel mixes tokens; everything after it in a Wan block is per token: the attention's
output projection, the gated residual add, the cross-attention (each query token attends the whole text on its
own), and the feed-forward, whose hidden state is the widest tensor of the block (8,960 wide for the 1.3B, 13,824
for the 14B, against 1,536 / 5,120 for the residual stream: at 32,760 tokens one of them is 561 MiB for the 1.3B
in bf16, and the backward pass of a recomputed block held four at once). Here the block runs diffusers' self-
attention up to its kernel (SelfAttentionCore), then `chunk_tokens` tokens at a time through the rest, each chunk
under its own (nested) non-reentrant checkpoint: the block keeps only the chunk inputs it already has (its input
and the kernel's output), and the backward pass recomputes one chunk at a time. peft's wrapped linears (LoRA,
DoRA, LoHa, LoKr) run inside the chunk as they are, and so does I2V's image context of the cross-attention. A
self-attention with another processor than diffusers' runs whole and only the feed-forward part is chunked.

It costs no extra compute inside a checkpointed block: when the backward pass recomputes the block, the chunks are
not computed (their outputs would be thrown away: nothing after them in the block keeps a tensor, and torch stops
the recomputation as soon as the last chunk's inputs are saved), and each chunk's own recomputation is then the
one forward pass of those parts the block's recomputation would have made. The cross-attention's keys and values
of the text are projected once per block, before the chunks (CrossAttentionText). A block that is not
checkpointed runs its chunks plainly (the same numbers, no saving of its kept activations, a smaller backward
transient).

The numbers: every token's forward is the same computation (norms and activations are per token); a matrix
product over fewer rows may take another kernel path, and the weight gradients are sums over the chunks instead
of one sum over all tokens, so the result is equal within float32 rounding (tested), not bit for bit.

The block is diffusers' WanTransformerBlock.forward (0.42) as written, in that order; the hook (diffusers' own
`ModelHook`) replaces the forward only, so module names and state dicts stay as they are.
"""
from __future__ import annotations

import torch
from diffusers.hooks import HookRegistry, ModelHook
from torch.utils.checkpoint import checkpoint

from modules.modelSetup.memory.BlockCheckpointing import checkpoint_state
from modules.modelSetup.memory import CrossAttentionText
from modules.modelSetup.memory.NormRecompute import float_norm
from modules.modelSetup.memory.SelfAttentionCore import (attention_kernel, output_projection, projections,
                                                         self_attention_core, splittable)

HOOK = "chunked_feed_forward"


def _feed_forward_part(block, hidden_states, shift, scale, gate):
    """diffusers' `3. Feed-forward` of WanTransformerBlock on some tokens: returns the block's output for them."""
    norm_hidden_states = (float_norm(block.norm3, hidden_states) * (1 + scale) + shift).type_as(hidden_states)
    ff_output = block.ffn(norm_hidden_states)
    return (hidden_states.float() + ff_output.float() * gate).type_as(hidden_states)


def _attention_inputs(block, hidden_states, shift, scale, cos, sin):
    """diffusers' `1. Self-attention` of WanTransformerBlock up to its kernel, on some tokens: the kernel's query,
    key and value for them."""
    norm_hidden_states = (float_norm(block.norm1, hidden_states) * (1 + scale) + shift).type_as(hidden_states)
    return projections(block.attn1, norm_hidden_states, None if cos is None else (cos, sin))


def _after_self_attention(block, hidden_states, core_output, gate_msa, shift, scale, gate, *context):
    """The rest of diffusers' WanTransformerBlock after the self-attention's kernel, on some tokens: its output
    projection, the gated residual add, the cross-attention (each query token attends the whole text on its own)
    and the feed-forward part. `context`: the text's (and image context's) keys and values, projected once for all
    chunks (_text_context), or the encoder states for a cross-attention run whole."""
    attn_output = output_projection(block.attn1, core_output)
    hidden_states = (hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)
    norm_hidden_states = float_norm(block.norm2, hidden_states).type_as(hidden_states)
    if len(context) == 1:
        attn_output = block.attn2(norm_hidden_states, context[0], None, None)
    else:
        attn_output = CrossAttentionText.cross_attention(block.attn2, norm_hidden_states, *context)
    hidden_states = hidden_states + attn_output
    return _feed_forward_part(block, hidden_states, shift, scale, gate)


def _text_context(block, encoder_hidden_states) -> list:
    """What every chunk's cross-attention takes of the text: its keys and values, projected here once per block
    (CrossAttentionText), or the encoder states where the cross-attention runs another processor."""
    if CrossAttentionText.splittable(block.attn2):
        return list(CrossAttentionText.keys_values(block.attn2, encoder_hidden_states))
    return [encoder_hidden_states]


def _not_computed(_block, hidden_states, *_rest):
    # the block is being recomputed for its backward pass: this chunk's output is thrown away (see module doc)
    return torch.empty_like(hidden_states)


class ChunkedFeedForward(ModelHook):
    def __init__(self, chunk_tokens: int, attention_inputs: bool = False):
        """`attention_inputs` (`performance.chunk_attention_inputs`): the self-attention's inputs too, see
        _chunked_attention_inputs."""
        super().__init__()
        self.chunk_tokens = chunk_tokens
        self.attention_inputs = attention_inputs
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
        if splittable(block.attn1) and self._chunks_attention_inputs(hidden_states):
            core_output = attention_kernel(block.attn1, *self._chunked_attention_inputs(
                block, hidden_states, shift_msa, scale_msa, rotary_emb))
            return self._chunked(block, _after_self_attention, [hidden_states, core_output],
                                 [gate_msa, c_shift_msa, c_scale_msa, c_gate_msa],
                                 _text_context(block, encoder_hidden_states))
        norm_hidden_states = (float_norm(block.norm1, hidden_states) * (1 + scale_msa) + shift_msa).type_as(
            hidden_states)
        if splittable(block.attn1):
            # its output projection, 2. cross-attention and 3. feed-forward: per token, in chunks
            core_output = self_attention_core(block.attn1, norm_hidden_states, rotary_emb)
            return self._chunked(block, _after_self_attention, [hidden_states, core_output],
                                 [gate_msa, c_shift_msa, c_scale_msa, c_gate_msa],
                                 _text_context(block, encoder_hidden_states))
        attn_output = block.attn1(norm_hidden_states, None, None, rotary_emb)
        hidden_states = (hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)

        # 2. Cross-attention
        norm_hidden_states = float_norm(block.norm2, hidden_states).type_as(hidden_states)
        attn_output = block.attn2(norm_hidden_states, encoder_hidden_states, None, None)
        hidden_states = hidden_states + attn_output

        # 3. Feed-forward, in chunks of tokens (dim 1 of (batch, tokens, width))
        return self._chunked(block, _feed_forward_part, [hidden_states], [c_shift_msa, c_scale_msa, c_gate_msa], [])

    def _chunks_attention_inputs(self, hidden_states) -> bool:
        state = checkpoint_state()
        return (self.attention_inputs and hidden_states.shape[1] > self.chunk_tokens and state.checkpointed
                and torch.is_grad_enabled())

    def _chunked_attention_inputs(self, block, hidden_states, shift, scale, rotary_emb):
        """The self-attention's norm, q/k/v projections, q/k norms and rotary embedding on `chunk_tokens` tokens at a
        time, each chunk under its own checkpoint: the block keeps none of their inputs but its own input (the
        norm's modulated output, the projections' outputs before their norms), and the backward pass computes them
        a third time, one chunk at a time (the block's recomputation must compute them: the kernel needs them)."""
        tokens = hidden_states.shape[1]
        cos, sin = rotary_emb if rotary_emb is not None else (None, None)
        per_token = [t.split(self.chunk_tokens, dim=1) if t is not None and t.shape[1] == tokens else None
                     for t in (hidden_states, shift, scale, cos, sin)]
        outputs = []
        for index in range(len(per_token[0])):
            chunk = [split[index] if split is not None else whole
                     for split, whole in zip(per_token, (hidden_states, shift, scale, cos, sin))]
            outputs.append(checkpoint(_attention_inputs, block, *chunk, use_reentrant=False))
        # query, key, value of all tokens: (batch, tokens, heads, head_dim)
        return [torch.cat(parts, dim=1) for parts in zip(*outputs)]

    def _chunked(self, block, part, token_inputs, modulation, shared):
        """`part(block, *token_inputs, *modulation, *shared)` on `chunk_tokens` tokens (dim 1) at a time:
        `token_inputs` are sliced, `modulation` too where it is per token (TI2V-5B's (batch, tokens, width)),
        `shared` is passed whole."""
        tokens = token_inputs[0].shape[1]
        if tokens <= self.chunk_tokens:
            self.chunks_run += 1
            return part(block, *token_inputs, *modulation, *shared)
        state = checkpoint_state()
        nested = state.checkpointed and torch.is_grad_enabled()
        run = _not_computed if state.recomputing else part
        # split, not sliced: the chunks' input gradients meet in one SplitBackward that joins them once, where
        # each slice's gradient would be a zero-filled tensor of all tokens, added to the others one by one
        per_token = [t.split(self.chunk_tokens, dim=1) for t in token_inputs] + [
            m.split(self.chunk_tokens, dim=1) if m.shape[1] == tokens else None for m in modulation]
        outputs = []
        for index in range(len(per_token[0])):
            chunk = [split[index] if split is not None else whole
                     for split, whole in zip(per_token, token_inputs + modulation)] + shared
            if run is part:
                self.chunks_run += 1
            if nested:
                outputs.append(checkpoint(run, block, *chunk, use_reentrant=False))
            else:
                outputs.append(run(block, *chunk))
        return torch.cat(outputs, dim=1)


def chunk_feed_forward(blocks, chunk_tokens: int, attention_inputs: bool = False) -> list[ChunkedFeedForward]:
    """Hooks each given block (before any other hook on it, so theirs still wrap the block); returns the hooks."""
    hooks = []
    for block in blocks:
        registry = HookRegistry.check_if_exists_or_initialize(block)
        hook = registry.get_hook(HOOK)
        if hook is None:
            hook = ChunkedFeedForward(chunk_tokens)
            registry.register_hook(hook, HOOK)
        hook.chunk_tokens = chunk_tokens
        hook.attention_inputs = attention_inputs
        hooks.append(hook)
    return hooks
