"""FLOAT_8 base weights upcast again in the backward pass instead of kept for it.

diffusers' layerwise casting upcasts a Linear layer's float8 weight to bfloat16 for its forward pass and drops it
after, but `F.linear` saves the bfloat16 copy for the backward pass (the input's gradient needs the weight), so
every layer run since the last backward pass (with checkpointing: every layer of the block being recomputed) holds
its weight in bfloat16 beside the float8 one, twice the float8 bytes. Here the layer runs as `_Float8Linear`: its
forward upcasts as the casting hook did (the same numbers), saves no tensor, and its backward upcasts the stored
float8 weight again. The frozen weight has no gradient, so the input is not needed either.

The hook stands aside (the layer runs as before) when the weight is not float8 at call time, as over a sharded base
where FSDP2 has gathered it in bfloat16 already, or when the weight or bias trains. nf4 and int8 layers need no
help: bitsandbytes saves the quantised weight and dequantises it in its backward pass.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.hooks.layerwise_casting import LayerwiseCastingHook

HOOK_NAME = "float8_upcast_in_backward"


class _Float8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: torch.nn.Linear, dtype: torch.dtype) -> torch.Tensor:
        ctx.layer, ctx.dtype = layer, dtype
        bias = layer.bias.to(dtype) if layer.bias is not None else None
        return F.linear(x, layer.weight.to(dtype), bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight = ctx.layer.weight.to(device=grad.device, dtype=ctx.dtype)
        # as linear's own backward computes it: the flattened (tokens, out) gradient times the (out, in) weight
        grad_x = grad.reshape(-1, grad.shape[-1]).mm(weight).view(*grad.shape[:-1], weight.shape[1])
        return grad_x, None, None


class Float8UpcastHook(ModelHook):
    _is_stateful = False

    def __init__(self, storage_dtype: torch.dtype, compute_dtype: torch.dtype):
        super().__init__()
        self.storage_dtype, self.compute_dtype = storage_dtype, compute_dtype

    def new_forward(self, module: torch.nn.Linear, x: torch.Tensor, *args, **kwargs):
        frozen = not module.weight.requires_grad and (module.bias is None or not module.bias.requires_grad)
        if args or kwargs or not frozen or module.weight.dtype != self.storage_dtype:
            return self.fn_ref.original_forward(x, *args, **kwargs)
        return _Float8Linear.apply(x, module, self.compute_dtype)


def upcast_float8_in_backward(model: torch.nn.Module, skip: tuple[torch.nn.Module, ...] = ()) -> int:
    """Hooks every Linear layer of `model` that diffusers' layerwise casting stores in float8 (outside the modules
    in `skip`); returns how many."""
    skipped = {id(module) for root in skip for module in root.modules()}
    count = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or id(module) in skipped:
            continue
        registry = getattr(module, "_diffusers_hook", None)
        if registry is None or HOOK_NAME in registry.hooks:
            continue
        casting = [hook for hook in registry.hooks.values() if isinstance(hook, LayerwiseCastingHook)
                   and hook.storage_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)]
        if casting:
            HookRegistry.check_if_exists_or_initialize(module).register_hook(
                Float8UpcastHook(casting[0].storage_dtype, casting[0].compute_dtype), HOOK_NAME)
            count += 1
    return count
