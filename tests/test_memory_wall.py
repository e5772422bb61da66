"""The memory wall: `performance.chunk_tokens` (the block's per-token parts after the self-attention's kernel, and its
recomputed norms, in token chunks) leaves a fixed-seed step's loss and gradients unchanged within float32 rounding, really runs in chunks
(and computes none of them when a checkpointed block is recomputed), works with block swap, and lowers the counted
peak of a real-width block by exactly what the planner predicts."""
import pytest
import torch

from modules.benchmark.architectures import build_empty_transformer, get_architecture, make_wan_model, materialize
from modules.modelSetup.WanFineTuneSetup import WanFineTuneSetup
from modules.modelSetup.WanLoRASetup import WanLoRASetup
from modules.util.config.TrainConfig import TrainConfig

ARCH = get_architecture("tiny")          # 2 blocks, d 64, FFN 256
LATENT = ARCH.latent_shape(9, 32, 32)    # 12 video tokens: chunks of 5 make 3 chunks (5, 5, 2)


def one_step(chunk_tokens: int, checkpointing: bool, method: str = "LORA", performance: dict | None = None):
    """(loss, gradients by name, setup, and per block the calls of the feed-forward, of the self-attention's output
    projection, of its query projection and of the cross-attention's key projection) of one fp32 step of the tiny
    transformer;
    the adapters' B matrices are random (peft starts them at zero, which would leave the A gradients zero)."""
    torch.manual_seed(0)
    transformer = materialize(build_empty_transformer(ARCH), torch.float32, torch.device("cpu"), seed=0)
    transformer.requires_grad_(False)
    config = TrainConfig(gradient_checkpointing=checkpointing, train_dtype="FLOAT_32", training_method=method,
                         lora={"rank": 4, "alpha": 4.0},
                         performance={"chunk_tokens": chunk_tokens, **(performance or {})})
    setup = (WanLoRASetup if method == "LORA" else WanFineTuneSetup)(config, make_wan_model(ARCH, transformer))
    setup.setup_model()
    setup.move_experts_to_device()
    generator = torch.Generator().manual_seed(2)
    for name, parameter in transformer.named_parameters():
        if "lora_B" in name:
            parameter.data = torch.randn(parameter.shape, generator=generator) * 0.1
    calls = [0] * len(transformer.blocks)
    out_calls = [0] * len(transformer.blocks)   # the self-attention's output projection
    q_calls = [0] * len(transformer.blocks)     # ... and its query projection
    k_calls = [0] * len(transformer.blocks)     # the cross-attention's key projection (of the text)
    for index, block in enumerate(transformer.blocks):
        block.ffn.register_forward_pre_hook(lambda *_, i=index: calls.__setitem__(i, calls[i] + 1))
        block.attn1.to_out[0].register_forward_pre_hook(
            lambda *_, i=index: out_calls.__setitem__(i, out_calls[i] + 1))
        block.attn1.to_q.register_forward_pre_hook(lambda *_, i=index: q_calls.__setitem__(i, q_calls[i] + 1))
        block.attn2.to_k.register_forward_pre_hook(lambda *_, i=index: k_calls.__setitem__(i, k_calls[i] + 1))
    generator = torch.Generator().manual_seed(1)
    batch = {"latents": torch.randn(1, *LATENT, generator=generator),
             "text_embeds": torch.randn(1, 512, ARCH.text_dim, generator=generator)}
    loss = setup.calculate_loss(batch, setup.predict(batch, torch.Generator().manual_seed(1)))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in transformer.named_parameters() if p.requires_grad}
    return loss.detach(), grads, setup, calls, out_calls, q_calls, k_calls


def assert_equal_within_float32_rounding(result, reference):
    assert torch.equal(result[0], reference[0])   # the forward pass is the same computation token by token
    assert result[1].keys() == reference[1].keys()
    for name, grad in result[1].items():
        assert grad.abs().max() > 0, name
        # weight gradients are summed chunk by chunk instead of over all tokens at once
        torch.testing.assert_close(grad, reference[1][name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("method", ["LORA", "FINE_TUNE"])
def test_chunked_feed_forward_gives_the_same_step(method):
    for checkpointing in (False, True):
        reference = one_step(0, checkpointing, method)
        result = one_step(5, checkpointing, method)
        assert_equal_within_float32_rounding(result, reference)
        hooks = result[2].performance["transformer"].chunked_blocks
        assert [hook.chunks_run for hook in hooks] == [3, 3]   # 3 chunks in the forward pass
        if checkpointing:
            # the feed-forward runs once per chunk in the forward pass and once per chunk for its backward pass; the
            # block's own recomputation computes no chunk (its outputs would be thrown away)
            assert result[3] == [6, 6] and reference[3] == [2, 2]
            # the self-attention's output projection, the residual adds and the cross-attention run in the same
            # chunks: the block's recomputation stops after the attention kernel
            assert result[4] == [6, 6] and reference[4] == [2, 2]
            # the text's keys and values are projected once per block (and once in its recomputation), not per chunk
            assert result[6] == reference[6] == [2, 2]
        else:
            assert result[3] == [3, 3] and reference[3] == [1, 1]
            assert result[4] == [3, 3] and reference[4] == [1, 1]
            assert result[6] == reference[6] == [1, 1]


@pytest.mark.parametrize("method", ["LORA", "FINE_TUNE"])
def test_chunked_attention_inputs_give_the_same_step(method):
    """`performance.chunk_attention_inputs`: in a checkpointed block the self-attention's inputs are computed in
    chunks, kept by none, and computed a third time chunk by chunk in the backward pass; a block that is not
    checkpointed runs them whole (chunks would keep the same tensors)."""
    reference = one_step(0, True, method)
    result = one_step(5, True, method, performance={"chunk_attention_inputs": True})
    assert_equal_within_float32_rounding(result, reference)
    assert reference[5] == [2, 2]
    assert result[5] == [9, 9]    # 3 chunks in the forward pass, 3 in the block's recomputation, 3 for their backward
    assert result[3] == [6, 6] and result[4] == [6, 6]
    plain = one_step(5, False, method, performance={"chunk_attention_inputs": True})
    assert_equal_within_float32_rounding(plain, one_step(0, False, method))
    assert plain[5] == [1, 1]


def test_chunks_of_a_swapped_block_run_on_its_device_copy():
    """Block swap: a swapped block's chunks recompute in its backward pass after the block's recomputation has
    returned; its weights must still be the device copy then (on a GPU the host copy would be an error)."""
    import modules.modelSetup.BaseWanSetup as base
    seen = []
    original = base.BaseWanSetup.move_experts_to_device

    def move_and_watch(self):
        original(self)
        swap = self.performance["transformer"].block_swap
        linear = swap.blocks[1].ffn.net[0].proj.base_layer
        host = dict((id(p), h) for p, h in swap.host[1])[id(linear.weight)]
        linear.register_forward_pre_hook(lambda *_: seen.append(linear.weight.data_ptr() != host.data_ptr()))

    base.BaseWanSetup.move_experts_to_device = move_and_watch
    try:
        result = one_step(5, True, performance={"block_swap": 1})
    finally:
        base.BaseWanSetup.move_experts_to_device = original
    assert_equal_within_float32_rounding(result, one_step(0, True, performance={"block_swap": 1}))
    assert seen == [True] * 6                          # 3 chunks forward, 3 chunk recomputations
    assert not result[2].performance["transformer"].block_swap.resident   # evicted at the end of the backward pass


def test_counted_peak_of_a_real_width_block_falls_as_predicted():
    """One block of the 1.3B at its real width (1536, FFN 8960), 192 tokens in chunks of 64, LoRA, checkpointing,
    bf16 on the CPU: the counted peak of the real step falls by exactly what the planner's fake trace predicts,
    and at least by the two FFN-wide tensors and sixteen residual-wide tensors of the tokens not in the chunk (with
    the feed-forward part alone in chunks: about eleven; the self-attention's output projection, the residual adds
    and the cross-attention are chunked too), less the text's key and value gradients the chunks sum into (two
    tensors of 512 text tokens, whatever the number of video tokens)."""
    import dataclasses

    from modules.planner.plan_shapes import PlanShape
    from modules.planner.step_trace import trace_step
    arch = get_architecture("wan2.1-1.3b")
    arch = dataclasses.replace(arch, transformer={**arch.transformer, "num_layers": 1})
    shape = PlanShape(1, 9, 128, 128)   # latents 3 x 16 x 16: 192 tokens
    peaks = {}
    for chunk in (0, 64):
        config = TrainConfig(gradient_checkpointing=True, train_dtype="BFLOAT_16", lora={"rank": 4, "alpha": 4.0},
                             optimizer={"optimizer": "ADAMW"}, performance={"chunk_tokens": chunk},
                             model={"transformer": {"weight_dtype": "BFLOAT_16"}})
        torch.manual_seed(0)
        peaks[chunk] = [trace_step(config, arch, shape, fake=fake)[0].peak for fake in (False, True)]
    real_drop, predicted_drop = peaks[0][0] - peaks[64][0], peaks[0][1] - peaks[64][1]
    assert real_drop == predicted_drop, peaks
    text_gradients = 2 * 512 * 1536 * 2   # 3 MiB at any size (the keys and values are projected once per block)
    assert real_drop >= 2 * (192 - 64) * 8960 * 2 + 16 * (192 - 64) * 1536 * 2 - text_gradients, peaks


def test_counted_peak_with_chunked_attention_inputs_falls_as_predicted():
    """The same real-width block, chunks of 64 with and without `chunk_attention_inputs`: the counted peak falls by
    exactly the planner's prediction, and at least by three residual-wide tensors of the tokens not in the chunk
    (the modulated norm output, the query and key before their norms)."""
    import dataclasses

    from modules.planner.plan_shapes import PlanShape
    from modules.planner.step_trace import trace_step
    arch = get_architecture("wan2.1-1.3b")
    arch = dataclasses.replace(arch, transformer={**arch.transformer, "num_layers": 1})
    shape = PlanShape(1, 9, 128, 128)   # latents 3 x 16 x 16: 192 tokens
    peaks = {}
    for inputs in (False, True):
        config = TrainConfig(gradient_checkpointing=True, train_dtype="BFLOAT_16", lora={"rank": 4, "alpha": 4.0},
                             optimizer={"optimizer": "ADAMW"},
                             performance={"chunk_tokens": 64, "chunk_attention_inputs": inputs},
                             model={"transformer": {"weight_dtype": "BFLOAT_16"}})
        torch.manual_seed(0)
        peaks[inputs] = [trace_step(config, arch, shape, fake=fake)[0].peak for fake in (False, True)]
    real_drop, predicted_drop = peaks[False][0] - peaks[True][0], peaks[False][1] - peaks[True][1]
    assert real_drop == predicted_drop, peaks
    assert real_drop >= 3 * (192 - 64) * 1536 * 2, peaks


@pytest.mark.parametrize("fused", [False, True])
def test_chunks_share_the_text_and_image_keys_of_an_i2v_block(fused):
    """I2V's cross-attention (the image context in front of the 512 text tokens), its projections fused or not: a
    block in chunks of 5 tokens projects the text's and the image's keys and values once, and gives diffusers' own
    block's output and gradients within float32 rounding."""
    import copy

    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    from modules.modelSetup.memory.ChunkedFeedForward import chunk_feed_forward
    torch.manual_seed(0)
    reference = WanTransformerBlock(32, 64, 2, cross_attn_norm=True, added_kv_proj_dim=32)
    for parameter in reference.parameters():   # norms start at one and biases at zero: make every input count
        parameter.data = torch.randn_like(parameter) * 0.2
    if fused:
        reference.attn2.fuse_projections()
    chunked = copy.deepcopy(reference)
    chunk_feed_forward([chunked], 5)
    projections = ("to_kv", "to_added_kv") if fused else ("to_k", "add_k_proj")
    calls = {name: 0 for name in projections}
    for name in projections:
        getattr(chunked.attn2, name).register_forward_pre_hook(
            lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
    generator = torch.Generator().manual_seed(1)
    hidden_states = torch.randn(1, 12, 32, generator=generator)          # 12 tokens: chunks of 5, 5, 2
    context = torch.randn(1, 3 + 512, 32, generator=generator)           # 3 image tokens, then the text
    temb = torch.randn(1, 6, 32, generator=generator)
    rotary = (torch.randn(1, 12, 1, 16, generator=generator), torch.randn(1, 12, 1, 16, generator=generator))
    results = []
    for block in (reference, chunked):
        inputs = [t.clone().requires_grad_() for t in (hidden_states, context)]
        output = block(inputs[0], inputs[1], temb, rotary)
        output.square().sum().backward()
        results.append((output.detach(), [t.grad for t in inputs] + [p.grad for p in block.parameters()]))
    assert calls == {name: 1 for name in projections}   # once for the three chunks
    # matrix products over fewer rows and weight gradients summed chunk by chunk: float32 rounding of each tensor's
    # largest value (a wrong key, value or context would be off by its own size)
    for result, expected in zip([results[1][0], *results[1][1]], [results[0][0], *results[0][1]]):
        if expected is None:   # fused: the separate projections are left unused
            assert result is None
            continue
        assert expected.abs().max() > 0
        torch.testing.assert_close(result, expected, rtol=0, atol=1e-6 * float(expected.abs().max()))
