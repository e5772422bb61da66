"""Applying `LoraWeights` (modules/util/lora/formats.py) to a Wan transformer: merging into the base weights, and the
bridge to peft adapters (`transformer.add_adapter(LoraConfig(...), adapter_name=...)`, diffusers module names).

Alpha when copying into an existing peft adapter: the adapter keeps its own `lora_alpha` / `r` / `use_rslora`, and
lora_B is rescaled by (alpha / rank) / (adapter's scaling) so the adapter's delta equals the file's. Setting
`layer.scaling` instead would not survive diffusers' `set_adapters`, which recomputes scaling from lora_alpha / r.

peft LoHa / LoKr adapters (`peft.LoHaConfig` / `peft.LoKrConfig`) go through the same functions: their layers become
`LohaModule` / `LokrModule` (modules/util/lora/lycoris.py) whose delta equals peft's `get_delta_weight`, and such
modules load back into adapters of the same kind. `is_adapter_parameter` tells peft adapter parameters by name.
"""
import logging
import math

import torch
from torch import Tensor

from modules.util.lora.formats import LoraMatchError, LoraModule, LoraWeights
from modules.util.lora.lycoris import load_lycoris_into_peft, lycoris_from_peft, peft_lycoris_kind

logger = logging.getLogger(__name__)

_PEFT_PREFIX = "base_model.model."  # names under peft's get_peft_model wrapper
# parameter-name parts of peft's adapters: LoRA (lora_A/B, lora_magnitude_vector, lora_embedding_A/B), LoHa, LoKr
_ADAPTER_PARAMETER_TAGS = ("lora_", "hada_", "lokr_")


def is_adapter_parameter(name: str) -> bool:
    """Whether a parameter name (`blocks.0.attn1.to_q.hada_w1_a.default`) is a peft adapter's (LoRA, DoRA, LoHa or
    LoKr) rather than the base model's."""
    return any(tag in name for tag in _ADAPTER_PARAMETER_TAGS)


def dora_weight(weight: Tensor, delta: Tensor, dora_scale: Tensor) -> Tensor:
    """DoRA-adapted weight m * (W + dW) / ||W + dW||: (out, 1) magnitude -> row norms (peft, musubi-tuner),
    (1, in) -> column norms (LyCORIS / ComfyUI input axis). Linear (2-D) weights only."""
    if weight.dim() != 2:
        raise NotImplementedError(f"DoRA is supported on Linear weights only, not shape {tuple(weight.shape)}")
    combined = weight + delta
    scale = dora_scale.to(combined)
    if scale.dim() == 1:
        scale = scale.reshape(-1, 1)
    if scale.shape == (weight.shape[0], 1):
        norm = combined.norm(dim=1, keepdim=True)
    elif scale.shape == (1, weight.shape[1]):
        norm = combined.norm(dim=0, keepdim=True)
    else:
        raise ValueError(f"dora_scale {tuple(scale.shape)} fits neither axis of weight {tuple(weight.shape)}")
    return combined * (scale / norm)


def _base_layer(module: torch.nn.Module) -> torch.nn.Module:
    while hasattr(module, "base_layer"):  # peft wrappers (possibly nested)
        module = module.base_layer
    return module


def _get_module(root: torch.nn.Module, name: str) -> torch.nn.Module | None:
    for candidate in (name, _PEFT_PREFIX + name):
        try:
            return root.get_submodule(candidate)
        except AttributeError:
            continue
    return None


def _require_modules(root: torch.nn.Module, weights: LoraWeights) -> dict[str, torch.nn.Module]:
    modules = {name: _get_module(root, name) for name in weights}
    missing = sorted(name for name, module in modules.items() if module is None)
    if missing:
        raise LoraMatchError(f"{len(missing)} LoRA modules are not in the model (e.g. {missing[:5]}); "
                             f"filter with match_to_model first")
    return modules


@torch.no_grad()
def merge_lora(transformer: torch.nn.Module, weights: LoraWeights, strength: float = 1.0) -> None:
    """Adds each module's delta (times `strength`) into the base weight in place: float32 math, cast back.
    On peft-wrapped layers the base layer's weight is changed. DoRA modules: W + strength * (W_dora - W), as
    ComfyUI applies a strength."""
    modules = _require_modules(transformer, weights)
    for name, lora in weights.items():
        base = _base_layer(modules[name])
        weight = base.weight
        # a layer read from a ComfyUI fp8_scaled file holds weight / scale_weight (modules/util/fp8_scaled.py)
        scale = getattr(base, "scale_weight", None)
        w32 = weight.detach().to(torch.float32) * (scale.float() if scale is not None else 1.0)
        delta = lora.delta(dtype=torch.float32, device=weight.device)
        if delta.numel() != w32.numel():
            raise ValueError(f"{name}: LoRA delta {tuple(delta.shape)} does not fit weight {tuple(weight.shape)}")
        delta = delta.reshape(w32.shape)
        if lora.dora_scale is None:
            merged = w32 + strength * delta
        else:
            merged = w32 + strength * (dora_weight(w32, delta, lora.dora_scale.to(weight.device)) - w32)
        if scale is not None:
            finite = torch.finfo(weight.dtype).max   # float8 has no infinity: out-of-range values would become NaN
            merged = (merged / scale.float()).clamp(-finite, finite)
        weight.copy_(merged.to(weight.dtype))


def _peft_alpha(layer, adapter_name: str) -> float:
    """The adapter's alpha in our convention (delta = B @ A * alpha / rank): lora_alpha, or lora_alpha * sqrt(r)
    for rsLoRA (peft's scaling lora_alpha / sqrt(r)). Read from the config values, not `scaling`, which diffusers'
    set_adapters overwrites with a user weight."""
    r = layer.r[adapter_name]
    alpha = float(layer.lora_alpha[adapter_name])
    if getattr(layer, "use_rslora", {}).get(adapter_name, False):
        alpha *= math.sqrt(r)
    return alpha


def _adapter_layers(module: torch.nn.Module, adapter_name: str):
    """(name, layer, kind) of the peft layers holding `adapter_name`: kind "lora", "loha" or "lokr"."""
    from peft.tuners.lora import LoraLayer
    for name, layer in module.named_modules():
        if isinstance(layer, LoraLayer) and adapter_name in layer.lora_A:
            yield name.removeprefix(_PEFT_PREFIX), layer, "lora"
        else:
            kind = peft_lycoris_kind(layer, adapter_name)
            if kind is not None:
                yield name.removeprefix(_PEFT_PREFIX), layer, kind


def _uses_dora(layer, adapter_name: str) -> bool:
    return bool(getattr(layer, "use_dora", {}).get(adapter_name, False))


@torch.no_grad()
def lora_weights_from_peft(module: torch.nn.Module, adapter_name: str = "default") -> LoraWeights:
    """Copies (detached clones) of a peft adapter's tensors, keyed by the module names (diffusers names on a
    diffusers model; a `base_model.model.` prefix is removed). LoHa / LoKr layers give LohaModule / LokrModule."""
    weights: LoraWeights = {}
    for name, layer, kind in _adapter_layers(module, adapter_name):
        if kind != "lora":
            weights[name] = lycoris_from_peft(layer, adapter_name)
            continue
        down = layer.lora_A[adapter_name].weight.detach().clone()
        up = layer.lora_B[adapter_name].weight.detach().clone()
        dora = None
        if _uses_dora(layer, adapter_name):
            magnitude = layer.lora_magnitude_vector[adapter_name].weight.detach()
            if magnitude.dim() != 1:
                raise NotImplementedError(f"{name}: DoRA on non-Linear layers is not supported")
            dora = magnitude.clone().reshape(-1, 1)
        weights[name] = LoraModule(down=down, up=up, alpha=_peft_alpha(layer, adapter_name), dora_scale=dora)
    if not weights:
        raise LoraMatchError(f"the module has no peft LoRA / LoHa / LoKr layers with adapter {adapter_name!r}")
    return weights


@torch.no_grad()
def load_lora_weights_into_peft(module: torch.nn.Module, weights: LoraWeights, adapter_name: str = "default") -> None:
    """Copies `weights` into an existing peft adapter (same ranks). lora_B is rescaled so the adapter's scaling
    (its own lora_alpha / r) gives the file's alpha / rank. Adapter layers absent from `weights` are left as they
    are (logged); names absent from the model raise LoraMatchError. LoHa / LoKr modules go into adapters of the
    same kind and factor shapes (lycoris.load_lycoris_into_peft)."""
    found = list(_adapter_layers(module, adapter_name))
    layers = {name: layer for name, layer, _ in found}
    kinds = {name: kind for name, _, kind in found}
    missing = sorted(name for name in weights if name not in layers)
    if missing:
        raise LoraMatchError(f"{len(missing)} LoRA modules have no peft layer with adapter {adapter_name!r} "
                             f"(e.g. {missing[:5]})")
    for name, lora in weights.items():
        layer = layers[name]
        if kinds[name] != "lora" or not isinstance(lora, LoraModule):
            if kinds[name] == "lora":
                raise ValueError(f"{name}: the file holds a {type(lora).__name__.removesuffix('Module').upper()} "
                                 f"module but the adapter is LORA; set lora.type to match the file")
            load_lycoris_into_peft(name, layer, lora, adapter_name)
            continue
        a, b = layer.lora_A[adapter_name].weight, layer.lora_B[adapter_name].weight
        if a.shape != lora.down.shape or b.shape != lora.up.shape:
            raise ValueError(f"{name}: file down {tuple(lora.down.shape)} / up {tuple(lora.up.shape)} do not fit the "
                             f"adapter's lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} (rank must match)")
        layer_scale = _peft_alpha(layer, adapter_name) / layer.r[adapter_name]
        a.copy_(lora.down.to(a))
        b.copy_((lora.up.to(torch.float32) * (lora.scale / layer_scale)).to(b))
        uses_dora = _uses_dora(layer, adapter_name)
        if lora.dora_scale is not None:
            if not uses_dora:
                raise ValueError(f"{name}: the file has a DoRA magnitude but the adapter is not DoRA")
            magnitude = layer.lora_magnitude_vector[adapter_name].weight
            if lora.dora_scale.numel() != magnitude.numel() or lora.dora_scale.shape[0] != magnitude.shape[0]:
                raise ValueError(f"{name}: dora_scale {tuple(lora.dora_scale.shape)} is not a per-output-row "
                                 f"magnitude {tuple(magnitude.shape)} (input-axis DoRA cannot go into peft)")
            magnitude.copy_(lora.dora_scale.reshape(magnitude.shape).to(magnitude))
        elif uses_dora:
            raise ValueError(f"{name}: the adapter is DoRA but the file has no magnitude for it")
    untouched = len(layers) - len(weights)
    if untouched:
        logger.warning("peft adapter %r: %d of its layers are not in the LoRA file and keep their values",
                       adapter_name, untouched)
