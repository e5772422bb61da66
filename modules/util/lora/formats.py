"""LoRA files for the Wan transformer: one internal representation, three formats written, peers' layouts read.

Internally a LoRA is `LoraWeights`: diffusers module name of `WanTransformer3DModel` (`blocks.0.attn1.to_q`) ->
`LoraModule(down, up, alpha, dora_scale)`. The weight delta is `up @ down * alpha / rank` (times a user strength).
Linear layers and the Conv3d `patch_embedding` (down (rank, in, kt, kh, kw), up (out, rank, 1, 1, 1)) are both
handled; DoRA only on Linear layers.

Written (`lora_to_state_dict`, `save_lora_file`), DESIGN.md section 7:
- `COMFY_LORA`:     `diffusion_model.<original name>.lora_A.weight / .lora_B.weight / .alpha [/ .dora_scale]`
- `KOHYA_LORA`:     `lora_unet_<original name, dots as _>.lora_down.weight / .lora_up.weight / .alpha [/ .dora_scale]`
- `DIFFUSERS_LORA`: `transformer.<diffusers name>.lora_A.weight / .lora_B.weight [/ .lora_magnitude_vector]`, no
  alpha key: diffusers assumes alpha = rank for this layout, so alpha / rank is folded into lora_B.
`.alpha` is a 0-dim float32 tensor. `.dora_scale` is the name ComfyUI reads (comfy/lora.py `load_lora`).

DoRA: `dora_scale` is kept 2-D, as ComfyUI / LyCORIS store it: (out, 1) is a per-output-row magnitude (peft's
`lora_magnitude_vector`, musubi-tuner's `dora_layer.weight`), W' = m * (W + dW) / ||W + dW||_row; (1, in) is
LyCORIS' input-axis form, W' = m * (W + dW) / ||W + dW||_column. NOTE: ComfyUI's `weight_decompose` divides the
(out, 1) form by the norm of the *base* weight ||W||_row instead of ||W + dW||_row, so a peft-trained DoRA file does
not reproduce exactly in ComfyUI (plain LoRA does).

Read (`lora_from_state_dict`, `load_lora_file`), returned layout names:
- `comfy`:          `diffusion_model.` / `model.diffusion_model.` + lora_A/B (or lora_down/up) with `.alpha`
- `diffusion-pipe`: the same without `.alpha` (diffusion-pipe, ai-toolkit): alpha = rank
- `kohya`:          `lora_unet_<original name>` lora_down/up (+ alpha); ours and musubi-tuner's. musubi extras:
                    `use_rslora_flag` (scale alpha / sqrt(rank)), `dora_layer.weight`. No alpha: alpha = rank
                    (sd-scripts' "old LoRA without alpha" rule and ComfyUI's; musubi itself always writes alpha)
- `onetrainer`:     `lora_transformer_<diffusers name, dots as _>` lora_down/up/alpha
- `diffusers`:      `transformer.<name>` lora_A/B (diffusers, finetrainers); alpha from `.alpha` keys, else from the
                    `lora_adapter_metadata` header (`load_lora_file` only), else rank
- `diffsynth`:      no prefix, original names, `.lora_A.default.weight` or `.lora_A.weight` (DiffSynth-Studio)
- `peft`:           no prefix or `base_model.model.`, diffusers names (a peft state dict)
Names in either naming are accepted under every dotted prefix (`is_original_format` decides per prefix group).

LoHa / LoKr (LyCORIS) modules (modules/util/lora/lycoris.py) share `LoraWeights` as `LohaModule` / `LokrModule`,
which have the same `delta()`, `alpha`, `scale`, `dora_scale` (always None) and `cast_factors()`. Written under the
COMFY_LORA or KOHYA_LORA stems with their LyCORIS suffixes (`.hada_w1_a`, ..., `.lokr_w1`, ..., `.alpha`), read back
from any prefix above. DIFFUSERS_LORA has no standard for them and refuses them.
"""
import json
import logging
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import Tensor

from modules.util.atomic import save_safetensors_atomic
from modules.util.enum.ModelFormat import ModelFormat
from modules.util.lora.lycoris import (LYCORIS_SUFFIXES, LohaModule, LokrModule, LycorisModule, is_lycoris_roles,
                                          lycoris_from_roles, lycoris_state_items)
from modules.util.lora.face_adapter import fuse_face_key_value, split_face_key_value
from modules.util.lora.LoraModule import LoraModule
from modules.util.lora.keys import (KEY_TABLE, animate_2_to_original, diffusers_module_to_original,
                                   is_animate_2_modules, is_original_format, names_animate_2_attention,
                                   original_module_to_diffusers)

logger = logging.getLogger(__name__)


AdapterModule = LoraModule | LohaModule | LokrModule
LoraWeights = dict[str, AdapterModule]


class LoraMatchError(ValueError):
    """A LoRA file's modules do not fit the model."""


LAYOUT_COMFY = "comfy"
LAYOUT_DIFFUSION_PIPE = "diffusion-pipe"
LAYOUT_KOHYA = "kohya"
LAYOUT_ONETRAINER = "onetrainer"
LAYOUT_DIFFUSERS = "diffusers"
LAYOUT_DIFFSYNTH = "diffsynth"
LAYOUT_PEFT = "peft"

COMFY_PREFIX = "diffusion_model."
KOHYA_PREFIX = "lora_unet_"
DIFFUSERS_PREFIX = "transformer."

# (prefix, kind). Dotted kinds name modules with dots, underscore kinds with underscores. Longest first.
_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.diffusion_model.", "comfy"), ("diffusion_model.", "comfy"), ("lora_unet_", "kohya"),
    ("lora_transformer_", "onetrainer"), ("lora_", "kohya_other"),  # lora_te_ etc.: not the transformer
    ("base_model.model.", "peft"), ("transformer.", "diffusers"), ("", "bare"),
)
_UNDERSCORE_KINDS = ("kohya", "onetrainer")

# key suffix -> role; longest first so `.lora_A.default.weight` wins over `.weight`-less forms
_SUFFIXES: tuple[tuple[str, str], ...] = (
    (".lora_magnitude_vector.default.weight", "magnitude"), (".lora_magnitude_vector.weight", "magnitude"),
    (".lora_magnitude_vector", "magnitude"), (".dora_layer.weight", "magnitude"),
    (".lora_A.default.weight", "down"), (".lora_B.default.weight", "up"),
    (".lora_down.weight", "down"), (".lora_up.weight", "up"),
    (".lora_A.weight", "down"), (".lora_B.weight", "up"),
    (".dora_scale", "dora_scale"), (".alpha", "alpha"),
    *LYCORIS_SUFFIXES,  # .hada_w1_a ... / .lokr_w1 ...: no suffix of one is another's
)
_GLOBAL_KEYS = ("use_rslora_flag", "use_dora_flag")  # musubi-tuner network buffers


# ---------------------------------------------------------------------------------------------------- writing
def _alpha_tensor(alpha: float) -> Tensor:
    return torch.tensor(float(alpha), dtype=torch.float32)


def _dora_2d(module: LoraModule) -> Tensor:
    scale = module.dora_scale
    if scale.dim() == 1:
        scale = scale.reshape(-1, 1)
    return scale


def lora_to_state_dict(weights: LoraWeights, fmt: ModelFormat, dtype: torch.dtype | None = None) -> dict[str, Tensor]:
    """The tensors of a LoRA file in `fmt` (COMFY_LORA, KOHYA_LORA or DIFFUSERS_LORA); down/up (and dora_scale)
    cast to `dtype` when given; `.alpha` always float32."""
    fmt = ModelFormat(fmt)
    out: dict[str, Tensor] = {}
    if fmt == ModelFormat.KOHYA_LORA:
        warn_what_musubi_ignores(weights)
    if fmt in (ModelFormat.COMFY_LORA, ModelFormat.KOHYA_LORA):
        weights = fuse_face_key_value(weights)   # the official names stack Animate's face key and value

    def cast(t: Tensor) -> Tensor:
        return t if dtype is None else t.to(dtype)

    # Animate-2's modules have their own official names (blocks.N.block.*)
    to_original = animate_2_to_original if is_animate_2_modules(weights) else diffusers_module_to_original
    for name, module in weights.items():
        if isinstance(module, (LohaModule, LokrModule)):
            out.update(_lycoris_to_state_dict(name, module, fmt, cast, to_original))
        elif fmt in (ModelFormat.COMFY_LORA, ModelFormat.KOHYA_LORA):
            original = to_original(name)
            if fmt == ModelFormat.COMFY_LORA:
                stem, a, b = COMFY_PREFIX + original, ".lora_A.weight", ".lora_B.weight"
            else:
                stem, a, b = KOHYA_PREFIX + original.replace(".", "_"), ".lora_down.weight", ".lora_up.weight"
            out[stem + a] = cast(module.down)
            out[stem + b] = cast(module.up)
            out[stem + ".alpha"] = _alpha_tensor(module.alpha)
            if module.dora_scale is not None:
                out[stem + ".dora_scale"] = cast(_dora_2d(module))
        elif fmt == ModelFormat.DIFFUSERS_LORA:
            stem = DIFFUSERS_PREFIX + name
            up = module.up if module.scale == 1.0 else (module.up.float() * module.scale).to(module.up.dtype)
            out[stem + ".lora_A.weight"] = cast(module.down)
            out[stem + ".lora_B.weight"] = cast(up)
            if module.dora_scale is not None:
                scale = _dora_2d(module)
                if scale.shape[1] != 1 or scale.shape[0] != module.up.shape[0]:
                    raise ValueError(f"{name}: the diffusers/peft layout holds only a per-output-row DoRA magnitude "
                                     f"(out, 1); this dora_scale is {tuple(scale.shape)}")
                out[stem + ".lora_magnitude_vector"] = cast(scale.reshape(-1))
        else:
            raise ValueError(f"{fmt} is not a LoRA file format (COMFY_LORA, KOHYA_LORA, DIFFUSERS_LORA)")
    return out


def _lycoris_to_state_dict(name: str, module: LycorisModule, fmt: ModelFormat, cast,
                           to_original=diffusers_module_to_original) -> dict[str, Tensor]:
    kind = "LoHa" if isinstance(module, LohaModule) else "LoKr"
    if fmt == ModelFormat.DIFFUSERS_LORA:
        raise ValueError(f"DIFFUSERS_LORA cannot hold {kind} modules ({name}): diffusers has no standard key names "
                         f"for LoHa / LoKr. Use COMFY_LORA (LyCORIS names, read by ComfyUI) or KOHYA_LORA")
    if fmt not in (ModelFormat.COMFY_LORA, ModelFormat.KOHYA_LORA):
        raise ValueError(f"{fmt} is not a LoRA file format (COMFY_LORA, KOHYA_LORA, DIFFUSERS_LORA)")
    original = to_original(name)
    stem = COMFY_PREFIX + original if fmt == ModelFormat.COMFY_LORA else KOHYA_PREFIX + original.replace(".", "_")
    out = {stem + suffix: cast(tensor) for suffix, tensor in lycoris_state_items(module).items()}
    out[stem + ".alpha"] = _alpha_tensor(module.alpha)
    return out


def warn_what_musubi_ignores(weights: LoraWeights) -> list[str]:
    """KOHYA_LORA is musubi-tuner's layout, but musubi-tuner does not apply everything the layout can hold: it ignores
    `.dora_scale` (the file applies as a plain LoRA there) and LoKr modules whose w1 is factorised too
    (`decompose_both`: `.lokr_w1_a` / `.lokr_w1_b`). One warning per kind; returns the warnings."""
    dora = sum(1 for m in weights.values() if getattr(m, "dora_scale", None) is not None)
    both = sum(1 for m in weights.values() if isinstance(m, LokrModule) and m.lokr_w1_a is not None)
    warnings = []
    if dora:
        warnings.append(f"KOHYA_LORA: {dora} DoRA module(s) carry .dora_scale, which musubi-tuner ignores (it "
                        f"applies them as plain LoRA); ComfyUI applies them")
    if both:
        warnings.append(f"KOHYA_LORA: {both} LoKr module(s) factorise w1 as well (decompose_both: .lokr_w1_a / "
                        f".lokr_w1_b), which musubi-tuner does not apply; ComfyUI does")
    for warning in warnings:
        logger.warning(warning)
    return warnings


def save_lora_file(weights: LoraWeights, fmt: ModelFormat, path: str | os.PathLike,
                   metadata: dict[str, str] | None = None, dtype: torch.dtype | None = None) -> None:
    """Writes a safetensors LoRA file atomically (temporary name, then rename)."""
    metadata = dict(metadata or {})
    bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
    if bad:
        raise TypeError(f"safetensors metadata must map str to str; offending keys: {bad[:5]}")
    save_safetensors_atomic(lora_to_state_dict(weights, fmt, dtype), path, metadata or None)


def diffusers_companion_path(path: str | os.PathLike) -> Path:
    """`<name>.safetensors` -> `<name>.diffusers.safetensors`: the DIFFUSERS_LORA file written beside a VACE-blocks
    LoRA in ComfyUI / kohya names (which diffusers' WanVACEPipeline.load_lora_weights refuses)."""
    path = Path(path)
    return path.with_name(path.name.removesuffix(".safetensors") + ".diffusers.safetensors")


def expert_lora_paths(path: str | os.PathLike) -> tuple[Path, Path]:
    """Wan 2.2 A14B: `<name>.safetensors` -> (`<name>_high_noise.safetensors`, `<name>_low_noise.safetensors`)."""
    path = Path(path)
    suffix = path.suffix if path.suffix == ".safetensors" else ""
    stem = path.name[: -len(suffix)] if suffix else path.name
    return (path.with_name(f"{stem}_high_noise.safetensors"), path.with_name(f"{stem}_low_noise.safetensors"))


def names_expert(path: str | os.PathLike, side: str) -> bool:
    """Whether a file's name already says it holds the `side` ('high' / 'low') expert: `high.safetensors`,
    `wan_high_noise.safetensors`, `my-LoRA-low-noise.safetensors`."""
    stem = Path(path).name.removesuffix(".safetensors").lower()
    return re.search(rf"(^|[^a-z0-9]){side}([ _-]?noise)?$", stem) is not None


def expert_output_paths(destination: str | os.PathLike, experts: list[str]) -> dict[str, Path]:
    """Where a Wan 2.2 A14B LoRA of the experts in training (`transformer`, `transformer_2`) is written: the
    expert pair of expert_lora_paths, except that one expert trained into a name that already says it keeps the
    name the user gave (`expert=high`, `high.safetensors`: not `high_high_noise.safetensors`)."""
    if len(experts) == 1 and names_expert(destination, "high" if experts[0] == "transformer" else "low"):
        return {experts[0]: Path(destination)}
    pair = dict(zip(("transformer", "transformer_2"), expert_lora_paths(destination)))
    return {expert: pair[expert] for expert in experts}


# ---------------------------------------------------------------------------------------------------- reading
def _split_key(key: str) -> tuple[str, str] | None:
    for suffix, role in _SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)], role
    return None


def _split_prefix(stem: str) -> tuple[str, str]:
    for prefix, kind in _PREFIXES:
        if stem.startswith(prefix):
            return kind, stem[len(prefix):]
    raise AssertionError("unreachable: the empty prefix matches everything")


def _expand_table(block_indices: Iterable[int]) -> list[tuple[str, str]]:
    pairs = []
    indices = sorted(set(block_indices))
    for original, diffusers in KEY_TABLE:
        if "{N}" in original:
            pairs += [(original.replace("{N}", str(n)), diffusers.replace("{N}", str(n))) for n in indices]
        else:
            pairs.append((original, diffusers))
    return pairs


def _underscore_maps(rests: Iterable[str], module_names: Iterable[str] | None) -> tuple[dict[str, str], dict[str, str]]:
    """(underscored original name -> diffusers name, underscored diffusers name -> diffusers name)."""
    if module_names is not None:
        pairs = []
        for name in module_names:
            try:
                pairs.append((diffusers_module_to_original(name), name))
            except KeyError:
                pairs.append((None, name))
    else:  # no model at hand: the key table, with the block indices found in the keys
        indices = {int(m.group(1)) for rest in rests for m in [re.match(r"blocks_(\d+)_", rest)] if m}
        pairs = _expand_table(indices)
    from_original = {o.replace(".", "_"): d for o, d in pairs if o is not None}
    from_diffusers = {d.replace(".", "_"): d for _, d in pairs}
    return from_original, from_diffusers


def _resolve_names(stems: list[str], module_names: Iterable[str] | None) -> tuple[dict[str, str], list[str]]:
    """stem -> diffusers module name (the raw stem where nothing fits, so match_to_model reports it), and the
    prefix kinds seen."""
    by_kind: dict[str, dict[str, str]] = {}
    for stem in stems:
        kind, rest = _split_prefix(stem)
        by_kind.setdefault(kind, {})[stem] = rest
    module_names = None if module_names is None else list(module_names)
    resolved: dict[str, str] = {}
    kinds = []
    for kind, group in by_kind.items():
        if kind == "kohya_other":
            resolved.update({stem: stem for stem in group})
            kinds.append(kind)
            continue
        if kind in _UNDERSCORE_KINDS:
            from_original, from_diffusers = _underscore_maps(group.values(), module_names)
            table = from_original if kind == "kohya" else from_diffusers
            for stem, rest in group.items():
                resolved[stem] = table.get(rest, stem)
            kinds.append(kind)
            continue
        # diffusers' Animate-2 names keep the official self_attn / cross_attn: its to_q ... tell them apart
        original = is_original_format(group.values()) and not names_animate_2_attention(group.values())
        for stem, rest in group.items():
            if original:
                try:
                    resolved[stem] = original_module_to_diffusers(rest)
                except KeyError:
                    resolved[stem] = stem
            else:
                resolved[stem] = rest
        kinds.append(f"{kind}:{'original' if original else 'diffusers'}")
    return resolved, kinds


def _layout_name(kinds: list[str], has_alpha: bool) -> str:
    names = []
    for kind in kinds:
        base, _, naming = kind.partition(":")
        if base == "comfy":
            name = LAYOUT_COMFY if has_alpha else LAYOUT_DIFFUSION_PIPE
        elif base in ("kohya", "kohya_other"):
            name = LAYOUT_KOHYA
        elif base == "onetrainer":
            name = LAYOUT_ONETRAINER
        elif base == "diffusers":
            name = LAYOUT_DIFFUSERS
        elif base == "bare" and naming == "original":
            name = LAYOUT_DIFFSYNTH
        else:
            name = LAYOUT_PEFT
        if name not in names:
            names.append(name)
    return "+".join(names)


def lora_from_state_dict(sd: Mapping[str, Tensor], module_names: Iterable[str] | None = None
                         ) -> tuple[LoraWeights, str]:
    """Reads any of the layouts in the module docstring into `LoraWeights` keyed by diffusers module names.

    `module_names` (diffusers names of the target model's modules) resolves underscored kohya names; without it
    the names come from the keys.py table. A name that resolves to nothing is kept as its raw key stem, so
    `match_to_model` lists it. Keys of no known role (`.diff`, `.diff_b`, `lora_B.bias`) are skipped with a warning.
    """
    rslora = bool(sd["use_rslora_flag"].item()) if "use_rslora_flag" in sd else False
    parts: dict[str, dict[str, Tensor]] = {}
    unknown = []
    for key, value in sd.items():
        if key in _GLOBAL_KEYS:
            continue
        split = _split_key(key)
        if split is None:
            unknown.append(key)
            continue
        stem, role = split
        parts.setdefault(stem, {})[role] = value
    if unknown:
        logger.warning("LoRA file: %d keys of no LoRA role ignored (e.g. %s)", len(unknown), unknown[:5])
    if not parts:
        raise LoraMatchError(f"no LoRA tensors in the file (keys, e.g.: {list(sd)[:5]})")

    names, kinds = _resolve_names(list(parts), module_names)
    weights: LoraWeights = {}
    has_alpha = False
    for stem, roles in parts.items():
        if is_lycoris_roles(roles):
            name = names[stem]
            if name in weights:
                raise ValueError(f"two LoRA modules in the file map to {name!r} (last: {stem!r})")
            has_alpha = has_alpha or "alpha" in roles
            weights[name] = lycoris_from_roles(stem, roles)
            continue
        if "down" not in roles or "up" not in roles:
            missing = "down/lora_A" if "down" not in roles else "up/lora_B"
            raise ValueError(f"LoRA module {stem!r} has no {missing} tensor (has: {sorted(roles)})")
        down, up = roles["down"], roles["up"]
        rank = down.shape[0]
        if up.shape[1] != rank:
            raise ValueError(f"LoRA module {stem!r}: rank of down {tuple(down.shape)} and up {tuple(up.shape)} differ")
        if "alpha" in roles:
            has_alpha = True
            alpha = float(roles["alpha"].float().item())
            if rslora:  # musubi-tuner RS-LoRA: scale alpha / sqrt(rank) = (alpha * sqrt(rank)) / rank
                alpha *= math.sqrt(rank)
        else:
            alpha = float(rank)
        dora = None
        if "dora_scale" in roles:
            dora = roles["dora_scale"]
            dora = dora.reshape(-1, 1) if dora.dim() == 1 else dora
        elif "magnitude" in roles:
            dora = roles["magnitude"].reshape(-1, 1)
        name = names[stem]
        if name in weights:
            raise ValueError(f"two LoRA modules in the file map to {name!r} (last: {stem!r})")
        weights[name] = LoraModule(down=down, up=up, alpha=alpha, dora_scale=dora)
    return split_face_key_value(weights), _layout_name(kinds, has_alpha)


def _apply_adapter_metadata(weights: LoraWeights, raw: str) -> None:
    """diffusers' `lora_adapter_metadata` header (a peft LoraConfig as JSON, keys prefixed `transformer.`):
    sets alpha from `lora_alpha` / `alpha_pattern` / `use_rslora` for files that carry no `.alpha` keys."""
    config = json.loads(raw)
    config = {k.removeprefix("transformer."): v for k, v in config.items()}
    if "lora_alpha" not in config:
        return
    pattern = config.get("alpha_pattern") or {}
    for name, module in weights.items():
        if not isinstance(module, LoraModule):
            continue
        alpha = float(config["lora_alpha"])
        for key, value in pattern.items():
            if re.fullmatch(rf"(.*\.)?(?:{key})", name):
                alpha = float(value)
                break
        if config.get("use_rslora"):
            alpha *= math.sqrt(module.rank)
        module.alpha = alpha


def load_lora_file(path: str | os.PathLike, module_names: Iterable[str] | None = None) -> tuple[LoraWeights, str]:
    """Reads a safetensors LoRA file (never pickle) into `LoraWeights` keyed by diffusers module names."""
    from safetensors import safe_open

    from modules.util.safetensors_only import require_safetensors
    require_safetensors(path, "LoRA file")
    with safe_open(str(path), framework="pt", device="cpu") as f:
        sd = {key: f.get_tensor(key) for key in f.keys()}
        metadata = f.metadata() or {}
    weights, layout = lora_from_state_dict(sd, module_names)
    if (layout in (LAYOUT_DIFFUSERS, LAYOUT_PEFT) and not any(k.endswith(".alpha") for k in sd)
            and metadata.get("lora_adapter_metadata")):
        _apply_adapter_metadata(weights, metadata["lora_adapter_metadata"])
    return weights, layout


def match_to_model(weights: LoraWeights, model_module_names: Iterable[str]) -> LoraWeights:
    """The part of `weights` whose names are modules of the model. Nothing matching raises LoraMatchError; a partial
    match logs a warning with the number skipped."""
    names = set(model_module_names)
    matched = {name: module for name, module in weights.items() if name in names}
    unmatched = sorted(name for name in weights if name not in names)
    if not matched:
        raise LoraMatchError(f"none of the {len(weights)} LoRA modules match the model; unmatched, e.g.: "
                             f"{unmatched[:5]}")
    if unmatched:
        logger.warning("LoRA: %d of %d modules do not match the model and are skipped (e.g. %s)",
                       len(unmatched), len(weights), unmatched[:5])
    return matched


# full-weight deltas: ComfyUI's comfy/lora.py reads `<stem>.diff` (added to the weight) and `<stem>.diff_b` (added to
# the bias); LightX2V's runtime LoRA the same (lightx2v/common/ops/utils.py build_lora_and_diff_names, mm_weight.py:
# `weight + weight_diff`, `bias + bias_diff`). Step-distill LoRAs extracted from a distilled model carry them.
# `<stem>.diff_m` is the delta of the parameter `<stem>.modulation` (a block's or the head's; diffusers'
# scale_shift_table): LightX2V's tools/extract/lora_extractor.py writes it and lightx2v/utils/lora_loader.py adds it;
# ComfyUI does not read that key (its name for the same delta is `<stem>.modulation.diff`, read above as a weight).
FULL_DELTA_SUFFIXES = ((".diff_b", "bias"), (".diff_m", "modulation"), (".diff", "weight"))


def split_full_deltas(sd: Mapping[str, Tensor], module_names: Iterable[str] | None = None
                      ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(the keys that are not full-weight deltas, {diffusers parameter name (`blocks.0.norm2.bias`): delta}). The
    deltas' stems are resolved as LoRA stems are (any prefix and naming `lora_from_state_dict` reads)."""
    rest: dict[str, Tensor] = {}
    found: dict[str, tuple[str, Tensor]] = {}
    for key, value in sd.items():
        suffix = next(((s, p) for s, p in FULL_DELTA_SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            rest[key] = value
        elif suffix[1] == "modulation":   # the parameter itself is the stem, as `.modulation.diff` names it
            found[key] = (key[: -len(suffix[0])] + ".modulation", "weight"), value
        else:
            found[key] = (key[: -len(suffix[0])], suffix[1]), value
    names, _ = _resolve_names(sorted({stem for (stem, _), _ in found.values()}), module_names)
    deltas = {f"{names[stem]}.{parameter}": value for (stem, parameter), value in found.values()}
    return rest, deltas
