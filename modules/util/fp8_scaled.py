"""Linear layers whose frozen weight is float8 with a per-tensor (or per-output-row) float32 scale, as ComfyUI's
`*_fp8_scaled.safetensors` files store them: the weight is dequantised per call, in the input's dtype, and dropped
after; the stored weight and its scale are never upcast as a whole."""
import torch
import torch.nn.functional as F


class ScaledFp8Linear(torch.nn.Linear):
    """A `torch.nn.Linear` (so peft wraps it for LoRA as any Linear) with a `scale_weight` buffer."""

    scale_weight: torch.Tensor

    def dequantised_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight.to(dtype) * self.scale_weight.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self.dequantised_weight(x.dtype), bias)


def make_scaled_fp8(module: torch.nn.Module, scale: torch.Tensor) -> None:
    """Turns a (meta-built) Linear into a ScaledFp8Linear holding `scale` (a scalar, or one value per output row)."""
    if not isinstance(module, torch.nn.Linear):
        raise TypeError(f"a scale_weight belongs to a Linear layer, not {type(module).__name__}")
    if scale.numel() == module.out_features and scale.numel() > 1:
        scale = scale.reshape(module.out_features, 1)   # per output row: broadcasts over (out, in)
    elif scale.numel() == 1:
        scale = scale.reshape(())
    else:
        raise ValueError(f"scale_weight of shape {tuple(scale.shape)} fits neither a scalar nor "
                         f"{module.out_features} output rows")
    module.__class__ = ScaledFp8Linear
    module.register_buffer("scale_weight", scale.to(torch.float32), persistent=True)


def has_scaled_fp8(model: torch.nn.Module) -> bool:
    return any(isinstance(module, ScaledFp8Linear) for module in model.modules())


def quantise_scaled_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 weight, float32 scalar scale) with the largest magnitude mapped to float8_e4m3fn's maximum, as
    ComfyUI's scaled fp8 files are made (a per-tensor absmax scale)."""
    weight = weight.detach().float()
    scale = (weight.abs().max() / torch.finfo(torch.float8_e4m3fn).max).clamp_min(1e-12)
    return (weight / scale).to(torch.float8_e4m3fn), scale.reshape(())
