"""FLOAT_8 base weights: the bfloat16 copy a layer computes with is made again in the backward pass, never saved."""
import copy

import pytest
import torch
from peft import LoraConfig, inject_adapter_in_model

from modules.modelSetup.memory.PerformanceSetup import PerformanceSetup
from modules.util.config.PerformanceConfig import PerformanceConfig
from modules.util.tiny_models import SPECS, make_transformer

TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2"]


def _float8_lora_transformer():
    transformer = make_transformer(SPECS["wan2.1-t2v"], seed=0).to(torch.bfloat16)
    transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    transformer.requires_grad_(False)
    torch.manual_seed(1)
    inject_adapter_in_model(LoraConfig(r=4, target_modules=TARGETS, init_lora_weights=False), transformer)
    for name, parameter in transformer.named_parameters():
        if "lora_" in name:
            parameter.data = parameter.data.float()
            parameter.requires_grad_(True)
    return transformer


def _step(transformer, hooked: bool, checkpointing: bool):
    """One forward and backward pass under bfloat16 autocast: (LoRA gradients, input gradient, (dtype, shape) of
    each tensor saved for the backward pass that is not a stored parameter)."""
    if hooked:
        setup = PerformanceSetup(transformer, PerformanceConfig(), checkpointing, torch.device("cpu")).apply()
        assert setup.float8_layers > 0
    elif checkpointing:
        transformer.enable_gradient_checkpointing()
    generator = torch.Generator().manual_seed(0)
    channels, text = transformer.config.in_channels, transformer.config.text_dim
    hidden = torch.randn(1, channels, 2, 8, 8, generator=generator).requires_grad_(True)
    context = torch.randn(1, 8, text, generator=generator)
    saved = []
    stored = {p.untyped_storage().data_ptr() for p in transformer.parameters()}   # not a copy made for compute

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in stored:
            saved.append((tensor.dtype, tuple(tensor.shape)))
        return tensor

    transformer.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), \
            torch.autocast("cpu", dtype=torch.bfloat16):
        out = transformer(hidden_states=hidden, timestep=torch.tensor([500]), encoder_hidden_states=context,
                          return_dict=False)[0]
    out.float().square().mean().backward()
    grads = {name: p.grad for name, p in transformer.named_parameters() if p.requires_grad}
    return grads, hidden.grad, saved


def test_a_float8_layers_upcast_weight_is_not_saved_for_the_backward_pass():
    reference = _float8_lora_transformer()
    weights = {(torch.bfloat16, tuple(m.weight.shape)) for m in reference.modules()
               if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.float8_e4m3fn}
    hooked = copy.deepcopy(reference)
    *_, saved_before = _step(reference, hooked=False, checkpointing=False)
    *_, saved_after = _step(hooked, hooked=True, checkpointing=False)
    # diffusers' layerwise casting alone keeps each layer's bfloat16 weight (or its transpose) for the backward pass
    upcast = weights | {(dtype, shape[::-1]) for dtype, shape in weights}
    assert sum(entry in upcast for entry in saved_before) >= 10
    assert [entry for entry in saved_after if entry in upcast] == []


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_gradients_with_the_upcast_made_again_equal_the_saved_upcasts(checkpointing):
    reference = _float8_lora_transformer()
    hooked = copy.deepcopy(reference)
    grads_before, input_before, _ = _step(reference, hooked=False, checkpointing=checkpointing)
    grads_after, input_after, _ = _step(hooked, hooked=True, checkpointing=checkpointing)
    assert grads_before.keys() == grads_after.keys() and len(grads_before) > 0
    assert all(torch.equal(grads_before[k], grads_after[k]) for k in grads_before)
    assert torch.equal(input_before, input_after)
