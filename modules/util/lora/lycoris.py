"""LoHa and LoKr (LyCORIS) adapter modules: the internal representation, their tensors in LyCORIS key names, and the
bridge to peft's `LoHaLayer` / `LoKrLayer`.

Key suffixes, after the module stem (`diffusion_model.<original name>` or `lora_unet_<original name, dots as _>`),
as ComfyUI reads them (comfy/weight_adapter/loha.py, lokr.py; no `.weight` suffix):
- LoHa: `.hada_w1_a` (out, r), `.hada_w1_b` (r, in), `.hada_w2_a` (out, r), `.hada_w2_b` (r, in) [, `.hada_t1`,
  `.hada_t2` (r, r, *kernel), Tucker form], `.alpha`.
  delta = (w1_a @ w1_b) * (w2_a @ w2_b) * alpha / r, r = hada_w1_b.shape[0]; no alpha: scale 1.
  Tucker: (einsum("i j ..., j r, i p -> p r ...", t1, w1_b, w1_a) * the same for t2/w2) * alpha / r.
- LoKr: `.lokr_w1` or `.lokr_w1_a` / `.lokr_w1_b`; `.lokr_w2` or `.lokr_w2_a` / `.lokr_w2_b` [/ `.lokr_t2`]; `.alpha`.
  delta = kron(w1, w2) * scale with w1 = w1_a @ w1_b and w2 = w2_a @ w2_b where factorised (w2 Tucker:
  einsum("i j ..., j r, i p -> p r ...", t2, w2_b, w2_a)). scale = alpha / dim, dim = lokr_w2_b.shape[0] when w2 is
  factorised, else lokr_w1_b.shape[0] when w1 is; when both are full the scale is 1 and alpha is ignored (ComfyUI's
  `calculate_weight`; LyCORIS writes alpha = its rank then).

peft computes the same products with the same orientation (peft/tuners/loha/layer.py `make_weight`,
lokr/layer.py `make_kron`), scaled by its `alpha / r` in every case. So LoHa and factorised LoKr carry peft's alpha
as they are; a LoKr with both factors full (small layers: peft keeps w2 full when r >= half its factor dims) has
peft's scale folded into `lokr_w1` and alpha written as r, so the file's delta is peft's `get_delta_weight` under
both rules.
DoRA (`dora_scale`) on LoHa / LoKr modules is not supported.
"""
from dataclasses import dataclass, fields

import torch
from torch import Tensor

HADA_ROLES = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2")
LOKR_ROLES = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b", "lokr_t2")
# key suffix -> role, for formats.py key splitting
LYCORIS_SUFFIXES: tuple[tuple[str, str], ...] = tuple(("." + role, role) for role in HADA_ROLES + LOKR_ROLES)


def _tucker(t: Tensor, w_a: Tensor, w_b: Tensor) -> Tensor:
    """(r, r, *kernel) core with the (r, out) / (r, in) mode factors -> (out, in, *kernel); ComfyUI's, peft's and
    LyCORIS' contraction."""
    return torch.einsum("i j ..., j r, i p -> p r ...", t, w_b, w_a)


def _cast(t: Tensor | None, dtype, device) -> Tensor | None:
    return None if t is None else t.to(device=device, dtype=dtype)


class _LycorisModule:
    dora_scale = None  # merge_lora reads it; not supported for these adapters

    def factors(self) -> dict[str, Tensor]:
        """Role (the key suffix without the dot) -> tensor, the factors present."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "alpha" and getattr(self, f.name) is not None}

    def cast_factors(self, dtype: torch.dtype) -> None:
        for role, tensor in self.factors().items():
            setattr(self, role, tensor.to(dtype))


@dataclass
class LohaModule(_LycorisModule):
    hada_w1_a: Tensor  # (out, r); Tucker: (r, out)
    hada_w1_b: Tensor  # (r, in); Tucker: (r, in)
    hada_w2_a: Tensor
    hada_w2_b: Tensor
    alpha: float
    hada_t1: Tensor | None = None  # (r, r, *kernel)
    hada_t2: Tensor | None = None

    @property
    def rank(self) -> int:
        return self.hada_w1_b.shape[0]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def delta(self, strength: float = 1.0, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
        """(w1_a @ w1_b) * (w2_a @ w2_b) * alpha / r * strength: (out, in), or (out, in, *kernel) for Tucker."""
        w = {role: _cast(t, dtype, device) for role, t in self.factors().items()}
        if self.hada_t1 is not None:
            m1 = _tucker(w["hada_t1"], w["hada_w1_a"], w["hada_w1_b"])
            m2 = _tucker(w["hada_t2"], w["hada_w2_a"], w["hada_w2_b"])
        else:
            m1 = w["hada_w1_a"] @ w["hada_w1_b"]
            m2 = w["hada_w2_a"] @ w["hada_w2_b"]
        return (m1 * m2) * (self.scale * strength)


@dataclass
class LokrModule(_LycorisModule):
    alpha: float
    lokr_w1: Tensor | None = None  # (a, c): out = a * b, in = c * d
    lokr_w1_a: Tensor | None = None  # (a, r)
    lokr_w1_b: Tensor | None = None  # (r, c)
    lokr_w2: Tensor | None = None  # (b, d[, *kernel])
    lokr_w2_a: Tensor | None = None  # (b, r); Tucker: (r, b)
    lokr_w2_b: Tensor | None = None  # (r, d[*kernel]); Tucker: (r, d)
    lokr_t2: Tensor | None = None  # (r, r, *kernel)

    def __post_init__(self):
        if (self.lokr_w1 is None) == (self.lokr_w1_a is None or self.lokr_w1_b is None):
            raise ValueError("LoKr module: needs lokr_w1, or lokr_w1_a and lokr_w1_b (one form)")
        if (self.lokr_w2 is None) == (self.lokr_w2_a is None or self.lokr_w2_b is None):
            raise ValueError("LoKr module: needs lokr_w2, or lokr_w2_a and lokr_w2_b (one form)")

    @property
    def rank(self) -> int | None:
        """The dimension alpha divides (ComfyUI: w2's when w2 is factorised, else w1's); None when both are full."""
        if self.lokr_w2 is None:
            return self.lokr_w2_b.shape[0]
        if self.lokr_w1 is None:
            return self.lokr_w1_b.shape[0]
        return None

    @property
    def scale(self) -> float:
        rank = self.rank
        return 1.0 if rank is None else self.alpha / rank

    def delta(self, strength: float = 1.0, dtype: torch.dtype = torch.float32, device=None) -> Tensor:
        """kron(w1, w2) * scale * strength: (out, in) for Linear layers."""
        w = {role: _cast(t, dtype, device) for role, t in self.factors().items()}
        w1 = w["lokr_w1"] if self.lokr_w1 is not None else w["lokr_w1_a"] @ w["lokr_w1_b"]
        if self.lokr_w2 is not None:
            w2 = w["lokr_w2"]
        elif self.lokr_t2 is not None:
            w2 = _tucker(w["lokr_t2"], w["lokr_w2_a"], w["lokr_w2_b"])
        else:
            w2 = w["lokr_w2_a"] @ w["lokr_w2_b"]
        w1 = w1.reshape(*w1.shape, *[1] * (w2.dim() - 2))  # kernel dims of w2 (ComfyUI: unsqueeze twice for 4-D)
        return torch.kron(w1, w2) * (self.scale * strength)


LycorisModule = LohaModule | LokrModule


def is_lycoris_roles(roles) -> bool:
    return any(role.startswith(("hada_", "lokr_")) for role in roles)


def lycoris_from_roles(stem: str, roles: dict[str, Tensor]) -> LycorisModule:
    """A LoHa / LoKr module from one key stem's tensors (role -> tensor, roles as in HADA_ROLES / LOKR_ROLES plus
    `alpha`, `dora_scale`). Missing alpha: scale 1, as ComfyUI."""
    hada = sorted(r for r in roles if r.startswith("hada_"))
    lokr = sorted(r for r in roles if r.startswith("lokr_"))
    others = sorted(r for r in roles if r not in HADA_ROLES + LOKR_ROLES and r != "alpha")
    if hada and lokr:
        raise ValueError(f"LyCORIS module {stem!r} mixes LoHa and LoKr tensors ({hada + lokr})")
    if "dora_scale" in others or "magnitude" in others:
        raise ValueError(f"LyCORIS module {stem!r}: DoRA (dora_scale) on LoHa / LoKr is not supported")
    if others:
        raise ValueError(f"LyCORIS module {stem!r} also has LoRA tensors ({others})")
    alpha = float(roles["alpha"].float().item()) if "alpha" in roles else None
    tensors = {role: roles[role] for role in hada + lokr}
    if hada:
        missing = [r for r in HADA_ROLES[:4] if r not in tensors]
        if missing or (("hada_t1" in tensors) != ("hada_t2" in tensors)):
            raise ValueError(f"LoHa module {stem!r} lacks {missing or ['hada_t1/hada_t2']} (has {hada})")
        module = LohaModule(alpha=0.0, **tensors)
        module.alpha = float(module.rank) if alpha is None else alpha
        return module
    try:
        module = LokrModule(alpha=0.0, **tensors)
    except ValueError as error:
        raise ValueError(f"{stem!r}: {error} (has {lokr})") from None
    module.alpha = (float(module.rank) if module.rank is not None else 1.0) if alpha is None else alpha
    return module


def lycoris_state_items(module: LycorisModule) -> dict[str, Tensor]:
    """Key suffix -> tensor (without `.alpha`) for a LoHa / LoKr module."""
    return {"." + role: tensor for role, tensor in module.factors().items()}


# ---------------------------------------------------------------------------------------------------- peft bridge
def peft_lycoris_kind(layer, adapter_name: str) -> str | None:
    """"loha" / "lokr" when `layer` is a peft LoHa / LoKr layer holding `adapter_name`, else None."""
    from peft.tuners.loha import LoHaLayer
    from peft.tuners.lokr import LoKrLayer
    if isinstance(layer, LoHaLayer) and adapter_name in layer.hada_w1_a:
        return "loha"
    if isinstance(layer, LoKrLayer) and (adapter_name in layer.lokr_w1 or adapter_name in layer.lokr_w1_a):
        return "lokr"
    return None


def _peft_factors(layer, roles, adapter_name: str) -> dict[str, Tensor]:
    return {role: getattr(layer, role)[adapter_name] for role in roles if adapter_name in getattr(layer, role)}


def _peft_scale(layer, adapter_name: str) -> float:
    """peft's alpha / r, from the config values (`scaling` is what diffusers' set_adapters overwrites)."""
    return float(layer.alpha[adapter_name]) / layer.r[adapter_name]


@torch.no_grad()
def lycoris_from_peft(layer, adapter_name: str) -> LycorisModule:
    """Detached copies of a peft LoHa / LoKr layer's factors whose `delta()` equals `layer.get_delta_weight`."""
    kind = peft_lycoris_kind(layer, adapter_name)
    if kind == "loha":
        tensors = {role: t.detach().clone() for role, t in _peft_factors(layer, HADA_ROLES, adapter_name).items()}
        module = LohaModule(alpha=float(layer.alpha[adapter_name]), **tensors)
        if module.rank != layer.r[adapter_name]:
            raise AssertionError(f"peft LoHa rank {layer.r[adapter_name]} != hada_w1_b rows {module.rank}")
        return module
    if kind == "lokr":
        tensors = {role: t.detach().clone() for role, t in _peft_factors(layer, LOKR_ROLES, adapter_name).items()}
        module = LokrModule(alpha=float(layer.alpha[adapter_name]), **tensors)
        if module.rank is None:  # both full: ComfyUI's scale is 1, so fold peft's alpha / r into w1
            scale = _peft_scale(layer, adapter_name)
            if scale != 1.0:
                module.lokr_w1 = (module.lokr_w1.float() * scale).to(module.lokr_w1.dtype)
            module.alpha = float(layer.r[adapter_name])
        elif module.rank != layer.r[adapter_name]:
            raise AssertionError(f"peft LoKr rank {layer.r[adapter_name]} != factor rank {module.rank}")
        return module
    raise TypeError(f"{type(layer).__name__} holds no peft LoHa / LoKr adapter {adapter_name!r}")


@torch.no_grad()
def load_lycoris_into_peft(name: str, layer, module, adapter_name: str) -> None:
    """Copies a LoHa / LoKr module into an existing peft adapter of the same kind and factor shapes; one factor is
    rescaled so the adapter's own alpha / r gives the file's delta."""
    kind = peft_lycoris_kind(layer, adapter_name)
    expected = {"loha": LohaModule, "lokr": LokrModule}.get(kind)
    if expected is None or not isinstance(module, expected):
        have = type(module).__name__.removesuffix("Module").upper()
        raise ValueError(f"{name}: the file holds a {have} module but the adapter is {(kind or 'lora').upper()}; "
                         f"set lora.type to match the file")
    target = _peft_factors(layer, HADA_ROLES if kind == "loha" else LOKR_ROLES, adapter_name)
    source = module.factors()
    if target.keys() != source.keys() or any(target[r].shape != source[r].shape for r in source):
        raise ValueError(f"{name}: file factors { {r: tuple(t.shape) for r, t in source.items()} } do not fit the "
                         f"adapter's { {r: tuple(t.shape) for r, t in target.items()} } (rank / decomposition "
                         f"settings must match)")
    ratio = module.scale / _peft_scale(layer, adapter_name)
    rescaled = "hada_w2_b" if kind == "loha" else ("lokr_w1" if "lokr_w1" in source else "lokr_w1_a")
    for role, tensor in source.items():
        value = tensor.to(torch.float32) * ratio if role == rescaled else tensor
        target[role].copy_(value.to(target[role]))
